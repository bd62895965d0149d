"""The sans-IO Pulsar protocol core: frames, commands, messages, batches,
compression, chunks and replication markers.  Nothing here touches a socket,
a file or a clock."""
