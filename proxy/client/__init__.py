"""The built-in Pulsar client, on Trio.

``async with PulsarClient("pulsar://127.0.0.1:6650") as client:`` then
``producer = await client.create_producer(topic)``, ``await producer.send(b"...")``,
``consumer = await client.subscribe(topic, "sub")``, ``msg = await consumer.receive()``,
``consumer.acknowledge(msg)``.  Protocol decisions (batching, chunking, pending
receipts, permits, acknowledgements, backoff) live in sans-IO modules of this
package; the Trio modules (connection, lookup, producer, consumer, client) only
carry bytes and time.
"""

from proxy.client.client import PulsarClient
from proxy.client.connection import TokenAuthentication
from proxy.client.consumer import Consumer, ConsumerConfig, MultiTopicConsumer
from proxy.client.message import EARLIEST, LATEST, Message, MessageId
from proxy.client.producer import PartitionedProducer, Producer, ProducerConfig
from proxy.client.reader import Reader
from proxy.client.receipt import Receipt

__all__ = [
    "EARLIEST", "LATEST", "Consumer", "ConsumerConfig", "Message", "MessageId", "MultiTopicConsumer",
    "PartitionedProducer", "Producer", "ProducerConfig", "PulsarClient", "Reader", "Receipt",
    "TokenAuthentication",
]
