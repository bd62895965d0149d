"""The sans-IO Pulsar protocol core: frames, commands, messages, batches,
compression, chunks and replication markers.  Nothing here touches a socket,
a file or a clock."""

from pathlib import Path as _Path

from proxy import compiled as _compiled

#: Modules scripts/setup.sh compiles with mypyc (proxy.compiled), in the relay's lane: the plain forms' walk runs
#: on each small read.
COMPILED_MODULES = ("plain_forms",)
_compiled.guard(__name__, _Path(__file__).parent, COMPILED_MODULES, _compiled.RELAY_LANE)
