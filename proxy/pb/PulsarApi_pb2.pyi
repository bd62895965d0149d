from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CompressionType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NONE: _ClassVar[CompressionType]
    LZ4: _ClassVar[CompressionType]
    ZLIB: _ClassVar[CompressionType]
    ZSTD: _ClassVar[CompressionType]
    SNAPPY: _ClassVar[CompressionType]

class ProducerAccessMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    Shared: _ClassVar[ProducerAccessMode]
    Exclusive: _ClassVar[ProducerAccessMode]
    WaitForExclusive: _ClassVar[ProducerAccessMode]
    ExclusiveWithFencing: _ClassVar[ProducerAccessMode]

class ServerError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UnknownError: _ClassVar[ServerError]
    MetadataError: _ClassVar[ServerError]
    PersistenceError: _ClassVar[ServerError]
    AuthenticationError: _ClassVar[ServerError]
    AuthorizationError: _ClassVar[ServerError]
    ConsumerBusy: _ClassVar[ServerError]
    ServiceNotReady: _ClassVar[ServerError]
    ProducerBlockedQuotaExceededError: _ClassVar[ServerError]
    ProducerBlockedQuotaExceededException: _ClassVar[ServerError]
    ChecksumError: _ClassVar[ServerError]
    UnsupportedVersionError: _ClassVar[ServerError]
    TopicNotFound: _ClassVar[ServerError]
    SubscriptionNotFound: _ClassVar[ServerError]
    ConsumerNotFound: _ClassVar[ServerError]
    TooManyRequests: _ClassVar[ServerError]
    TopicTerminatedError: _ClassVar[ServerError]
    ProducerBusy: _ClassVar[ServerError]
    InvalidTopicName: _ClassVar[ServerError]
    IncompatibleSchema: _ClassVar[ServerError]
    ConsumerAssignError: _ClassVar[ServerError]
    TransactionCoordinatorNotFound: _ClassVar[ServerError]
    InvalidTxnStatus: _ClassVar[ServerError]
    NotAllowedError: _ClassVar[ServerError]
    TransactionConflict: _ClassVar[ServerError]
    TransactionNotFound: _ClassVar[ServerError]
    ProducerFenced: _ClassVar[ServerError]

class AuthMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AuthMethodNone: _ClassVar[AuthMethod]
    AuthMethodYcaV1: _ClassVar[AuthMethod]
    AuthMethodAthens: _ClassVar[AuthMethod]

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    v0: _ClassVar[ProtocolVersion]
    v1: _ClassVar[ProtocolVersion]
    v2: _ClassVar[ProtocolVersion]
    v3: _ClassVar[ProtocolVersion]
    v4: _ClassVar[ProtocolVersion]
    v5: _ClassVar[ProtocolVersion]
    v6: _ClassVar[ProtocolVersion]
    v7: _ClassVar[ProtocolVersion]
    v8: _ClassVar[ProtocolVersion]
    v9: _ClassVar[ProtocolVersion]
    v10: _ClassVar[ProtocolVersion]
    v11: _ClassVar[ProtocolVersion]
    v12: _ClassVar[ProtocolVersion]
    v13: _ClassVar[ProtocolVersion]
    v14: _ClassVar[ProtocolVersion]
    v15: _ClassVar[ProtocolVersion]
    v16: _ClassVar[ProtocolVersion]
    v17: _ClassVar[ProtocolVersion]
    v18: _ClassVar[ProtocolVersion]
    v19: _ClassVar[ProtocolVersion]
    v20: _ClassVar[ProtocolVersion]
    v21: _ClassVar[ProtocolVersion]

class KeySharedMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AUTO_SPLIT: _ClassVar[KeySharedMode]
    STICKY: _ClassVar[KeySharedMode]

class SegmentState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACTIVE: _ClassVar[SegmentState]
    SEALED: _ClassVar[SegmentState]

class ScalableConsumerType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STREAM: _ClassVar[ScalableConsumerType]
    CHECKPOINT: _ClassVar[ScalableConsumerType]

class TxnAction(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMIT: _ClassVar[TxnAction]
    ABORT: _ClassVar[TxnAction]
NONE: CompressionType
LZ4: CompressionType
ZLIB: CompressionType
ZSTD: CompressionType
SNAPPY: CompressionType
Shared: ProducerAccessMode
Exclusive: ProducerAccessMode
WaitForExclusive: ProducerAccessMode
ExclusiveWithFencing: ProducerAccessMode
UnknownError: ServerError
MetadataError: ServerError
PersistenceError: ServerError
AuthenticationError: ServerError
AuthorizationError: ServerError
ConsumerBusy: ServerError
ServiceNotReady: ServerError
ProducerBlockedQuotaExceededError: ServerError
ProducerBlockedQuotaExceededException: ServerError
ChecksumError: ServerError
UnsupportedVersionError: ServerError
TopicNotFound: ServerError
SubscriptionNotFound: ServerError
ConsumerNotFound: ServerError
TooManyRequests: ServerError
TopicTerminatedError: ServerError
ProducerBusy: ServerError
InvalidTopicName: ServerError
IncompatibleSchema: ServerError
ConsumerAssignError: ServerError
TransactionCoordinatorNotFound: ServerError
InvalidTxnStatus: ServerError
NotAllowedError: ServerError
TransactionConflict: ServerError
TransactionNotFound: ServerError
ProducerFenced: ServerError
AuthMethodNone: AuthMethod
AuthMethodYcaV1: AuthMethod
AuthMethodAthens: AuthMethod
v0: ProtocolVersion
v1: ProtocolVersion
v2: ProtocolVersion
v3: ProtocolVersion
v4: ProtocolVersion
v5: ProtocolVersion
v6: ProtocolVersion
v7: ProtocolVersion
v8: ProtocolVersion
v9: ProtocolVersion
v10: ProtocolVersion
v11: ProtocolVersion
v12: ProtocolVersion
v13: ProtocolVersion
v14: ProtocolVersion
v15: ProtocolVersion
v16: ProtocolVersion
v17: ProtocolVersion
v18: ProtocolVersion
v19: ProtocolVersion
v20: ProtocolVersion
v21: ProtocolVersion
AUTO_SPLIT: KeySharedMode
STICKY: KeySharedMode
ACTIVE: SegmentState
SEALED: SegmentState
STREAM: ScalableConsumerType
CHECKPOINT: ScalableConsumerType
COMMIT: TxnAction
ABORT: TxnAction

class Schema(_message.Message):
    __slots__ = ("name", "schema_data", "type", "properties")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        None: _ClassVar[Schema.Type]
        String: _ClassVar[Schema.Type]
        Json: _ClassVar[Schema.Type]
        Protobuf: _ClassVar[Schema.Type]
        Avro: _ClassVar[Schema.Type]
        Bool: _ClassVar[Schema.Type]
        Int8: _ClassVar[Schema.Type]
        Int16: _ClassVar[Schema.Type]
        Int32: _ClassVar[Schema.Type]
        Int64: _ClassVar[Schema.Type]
        Float: _ClassVar[Schema.Type]
        Double: _ClassVar[Schema.Type]
        Date: _ClassVar[Schema.Type]
        Time: _ClassVar[Schema.Type]
        Timestamp: _ClassVar[Schema.Type]
        KeyValue: _ClassVar[Schema.Type]
        Instant: _ClassVar[Schema.Type]
        LocalDate: _ClassVar[Schema.Type]
        LocalTime: _ClassVar[Schema.Type]
        LocalDateTime: _ClassVar[Schema.Type]
        ProtobufNative: _ClassVar[Schema.Type]
        AutoConsume: _ClassVar[Schema.Type]
        External: _ClassVar[Schema.Type]
    None: Schema.Type
    String: Schema.Type
    Json: Schema.Type
    Protobuf: Schema.Type
    Avro: Schema.Type
    Bool: Schema.Type
    Int8: Schema.Type
    Int16: Schema.Type
    Int32: Schema.Type
    Int64: Schema.Type
    Float: Schema.Type
    Double: Schema.Type
    Date: Schema.Type
    Time: Schema.Type
    Timestamp: Schema.Type
    KeyValue: Schema.Type
    Instant: Schema.Type
    LocalDate: Schema.Type
    LocalTime: Schema.Type
    LocalDateTime: Schema.Type
    ProtobufNative: Schema.Type
    AutoConsume: Schema.Type
    External: Schema.Type
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_DATA_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    name: str
    schema_data: bytes
    type: Schema.Type
    properties: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, name: _Optional[str] = ..., schema_data: _Optional[bytes] = ..., type: _Optional[_Union[Schema.Type, str]] = ..., properties: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class MessageIdData(_message.Message):
    __slots__ = ("ledgerId", "entryId", "partition", "batch_index", "ack_set", "batch_size", "first_chunk_message_id")
    LEDGERID_FIELD_NUMBER: _ClassVar[int]
    ENTRYID_FIELD_NUMBER: _ClassVar[int]
    PARTITION_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    ACK_SET_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    FIRST_CHUNK_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ledgerId: int
    entryId: int
    partition: int
    batch_index: int
    ack_set: _containers.RepeatedScalarFieldContainer[int]
    batch_size: int
    first_chunk_message_id: MessageIdData
    def __init__(self, ledgerId: _Optional[int] = ..., entryId: _Optional[int] = ..., partition: _Optional[int] = ..., batch_index: _Optional[int] = ..., ack_set: _Optional[_Iterable[int]] = ..., batch_size: _Optional[int] = ..., first_chunk_message_id: _Optional[_Union[MessageIdData, _Mapping]] = ...) -> None: ...

class KeyValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class KeyLongValue(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...

class IntRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class EncryptionKeys(_message.Message):
    __slots__ = ("key", "value", "metadata")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    metadata: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., metadata: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class MessageMetadata(_message.Message):
    __slots__ = ("producer_name", "sequence_id", "publish_time", "properties", "replicated_from", "partition_key", "replicate_to", "compression", "uncompressed_size", "num_messages_in_batch", "event_time", "encryption_keys", "encryption_algo", "encryption_param", "schema_version", "partition_key_b64_encoded", "ordering_key", "deliver_at_time", "marker_type", "txnid_least_bits", "txnid_most_bits", "highest_sequence_id", "null_value", "uuid", "num_chunks_from_msg", "total_chunk_msg_size", "chunk_id", "null_partition_key", "compacted_batch_indexes", "schema_id", "entry_hash_min", "entry_hash_max")
    PRODUCER_NAME_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    PUBLISH_TIME_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    REPLICATED_FROM_FIELD_NUMBER: _ClassVar[int]
    PARTITION_KEY_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_TO_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    UNCOMPRESSED_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_IN_BATCH_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_KEYS_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_ALGO_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTION_PARAM_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARTITION_KEY_B64_ENCODED_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    DELIVER_AT_TIME_FIELD_NUMBER: _ClassVar[int]
    MARKER_TYPE_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NULL_VALUE_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NUM_CHUNKS_FROM_MSG_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNK_MSG_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_ID_FIELD_NUMBER: _ClassVar[int]
    NULL_PARTITION_KEY_FIELD_NUMBER: _ClassVar[int]
    COMPACTED_BATCH_INDEXES_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRY_HASH_MIN_FIELD_NUMBER: _ClassVar[int]
    ENTRY_HASH_MAX_FIELD_NUMBER: _ClassVar[int]
    producer_name: str
    sequence_id: int
    publish_time: int
    properties: _containers.RepeatedCompositeFieldContainer[KeyValue]
    replicated_from: str
    partition_key: str
    replicate_to: _containers.RepeatedScalarFieldContainer[str]
    compression: CompressionType
    uncompressed_size: int
    num_messages_in_batch: int
    event_time: int
    encryption_keys: _containers.RepeatedCompositeFieldContainer[EncryptionKeys]
    encryption_algo: str
    encryption_param: bytes
    schema_version: bytes
    partition_key_b64_encoded: bool
    ordering_key: bytes
    deliver_at_time: int
    marker_type: int
    txnid_least_bits: int
    txnid_most_bits: int
    highest_sequence_id: int
    null_value: bool
    uuid: str
    num_chunks_from_msg: int
    total_chunk_msg_size: int
    chunk_id: int
    null_partition_key: bool
    compacted_batch_indexes: _containers.RepeatedScalarFieldContainer[int]
    schema_id: bytes
    entry_hash_min: int
    entry_hash_max: int
    def __init__(self, producer_name: _Optional[str] = ..., sequence_id: _Optional[int] = ..., publish_time: _Optional[int] = ..., properties: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., replicated_from: _Optional[str] = ..., partition_key: _Optional[str] = ..., replicate_to: _Optional[_Iterable[str]] = ..., compression: _Optional[_Union[CompressionType, str]] = ..., uncompressed_size: _Optional[int] = ..., num_messages_in_batch: _Optional[int] = ..., event_time: _Optional[int] = ..., encryption_keys: _Optional[_Iterable[_Union[EncryptionKeys, _Mapping]]] = ..., encryption_algo: _Optional[str] = ..., encryption_param: _Optional[bytes] = ..., schema_version: _Optional[bytes] = ..., partition_key_b64_encoded: _Optional[bool] = ..., ordering_key: _Optional[bytes] = ..., deliver_at_time: _Optional[int] = ..., marker_type: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., highest_sequence_id: _Optional[int] = ..., null_value: _Optional[bool] = ..., uuid: _Optional[str] = ..., num_chunks_from_msg: _Optional[int] = ..., total_chunk_msg_size: _Optional[int] = ..., chunk_id: _Optional[int] = ..., null_partition_key: _Optional[bool] = ..., compacted_batch_indexes: _Optional[_Iterable[int]] = ..., schema_id: _Optional[bytes] = ..., entry_hash_min: _Optional[int] = ..., entry_hash_max: _Optional[int] = ...) -> None: ...

class SingleMessageMetadata(_message.Message):
    __slots__ = ("properties", "partition_key", "payload_size", "compacted_out", "event_time", "partition_key_b64_encoded", "ordering_key", "sequence_id", "null_value", "null_partition_key")
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    PARTITION_KEY_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    COMPACTED_OUT_FIELD_NUMBER: _ClassVar[int]
    EVENT_TIME_FIELD_NUMBER: _ClassVar[int]
    PARTITION_KEY_B64_ENCODED_FIELD_NUMBER: _ClassVar[int]
    ORDERING_KEY_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NULL_VALUE_FIELD_NUMBER: _ClassVar[int]
    NULL_PARTITION_KEY_FIELD_NUMBER: _ClassVar[int]
    properties: _containers.RepeatedCompositeFieldContainer[KeyValue]
    partition_key: str
    payload_size: int
    compacted_out: bool
    event_time: int
    partition_key_b64_encoded: bool
    ordering_key: bytes
    sequence_id: int
    null_value: bool
    null_partition_key: bool
    def __init__(self, properties: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., partition_key: _Optional[str] = ..., payload_size: _Optional[int] = ..., compacted_out: _Optional[bool] = ..., event_time: _Optional[int] = ..., partition_key_b64_encoded: _Optional[bool] = ..., ordering_key: _Optional[bytes] = ..., sequence_id: _Optional[int] = ..., null_value: _Optional[bool] = ..., null_partition_key: _Optional[bool] = ...) -> None: ...

class BrokerEntryMetadata(_message.Message):
    __slots__ = ("broker_timestamp", "index")
    BROKER_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    broker_timestamp: int
    index: int
    def __init__(self, broker_timestamp: _Optional[int] = ..., index: _Optional[int] = ...) -> None: ...

class CommandConnect(_message.Message):
    __slots__ = ("client_version", "auth_method", "auth_method_name", "auth_data", "protocol_version", "proxy_to_broker_url", "original_principal", "original_auth_data", "original_auth_method", "feature_flags", "proxy_version")
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    AUTH_METHOD_FIELD_NUMBER: _ClassVar[int]
    AUTH_METHOD_NAME_FIELD_NUMBER: _ClassVar[int]
    AUTH_DATA_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROXY_TO_BROKER_URL_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_AUTH_DATA_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_AUTH_METHOD_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    PROXY_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    auth_method: AuthMethod
    auth_method_name: str
    auth_data: bytes
    protocol_version: int
    proxy_to_broker_url: str
    original_principal: str
    original_auth_data: str
    original_auth_method: str
    feature_flags: FeatureFlags
    proxy_version: str
    def __init__(self, client_version: _Optional[str] = ..., auth_method: _Optional[_Union[AuthMethod, str]] = ..., auth_method_name: _Optional[str] = ..., auth_data: _Optional[bytes] = ..., protocol_version: _Optional[int] = ..., proxy_to_broker_url: _Optional[str] = ..., original_principal: _Optional[str] = ..., original_auth_data: _Optional[str] = ..., original_auth_method: _Optional[str] = ..., feature_flags: _Optional[_Union[FeatureFlags, _Mapping]] = ..., proxy_version: _Optional[str] = ...) -> None: ...

class FeatureFlags(_message.Message):
    __slots__ = ("supports_auth_refresh", "supports_broker_entry_metadata", "supports_partial_producer", "supports_topic_watchers", "supports_get_partitioned_metadata_without_auto_creation", "supports_repl_dedup_by_lid_and_eid", "supports_topic_watcher_reconcile", "supports_scalable_topics", "supports_tc_metadata_discovery")
    SUPPORTS_AUTH_REFRESH_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_BROKER_ENTRY_METADATA_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_PARTIAL_PRODUCER_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TOPIC_WATCHERS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_GET_PARTITIONED_METADATA_WITHOUT_AUTO_CREATION_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_REPL_DEDUP_BY_LID_AND_EID_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TOPIC_WATCHER_RECONCILE_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_SCALABLE_TOPICS_FIELD_NUMBER: _ClassVar[int]
    SUPPORTS_TC_METADATA_DISCOVERY_FIELD_NUMBER: _ClassVar[int]
    supports_auth_refresh: bool
    supports_broker_entry_metadata: bool
    supports_partial_producer: bool
    supports_topic_watchers: bool
    supports_get_partitioned_metadata_without_auto_creation: bool
    supports_repl_dedup_by_lid_and_eid: bool
    supports_topic_watcher_reconcile: bool
    supports_scalable_topics: bool
    supports_tc_metadata_discovery: bool
    def __init__(self, supports_auth_refresh: _Optional[bool] = ..., supports_broker_entry_metadata: _Optional[bool] = ..., supports_partial_producer: _Optional[bool] = ..., supports_topic_watchers: _Optional[bool] = ..., supports_get_partitioned_metadata_without_auto_creation: _Optional[bool] = ..., supports_repl_dedup_by_lid_and_eid: _Optional[bool] = ..., supports_topic_watcher_reconcile: _Optional[bool] = ..., supports_scalable_topics: _Optional[bool] = ..., supports_tc_metadata_discovery: _Optional[bool] = ...) -> None: ...

class CommandConnected(_message.Message):
    __slots__ = ("server_version", "protocol_version", "max_message_size", "feature_flags")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    FEATURE_FLAGS_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    protocol_version: int
    max_message_size: int
    feature_flags: FeatureFlags
    def __init__(self, server_version: _Optional[str] = ..., protocol_version: _Optional[int] = ..., max_message_size: _Optional[int] = ..., feature_flags: _Optional[_Union[FeatureFlags, _Mapping]] = ...) -> None: ...

class CommandAuthResponse(_message.Message):
    __slots__ = ("client_version", "response", "protocol_version")
    CLIENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_version: str
    response: AuthData
    protocol_version: int
    def __init__(self, client_version: _Optional[str] = ..., response: _Optional[_Union[AuthData, _Mapping]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class CommandAuthChallenge(_message.Message):
    __slots__ = ("server_version", "challenge", "protocol_version")
    SERVER_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHALLENGE_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    server_version: str
    challenge: AuthData
    protocol_version: int
    def __init__(self, server_version: _Optional[str] = ..., challenge: _Optional[_Union[AuthData, _Mapping]] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class AuthData(_message.Message):
    __slots__ = ("auth_method_name", "auth_data")
    AUTH_METHOD_NAME_FIELD_NUMBER: _ClassVar[int]
    AUTH_DATA_FIELD_NUMBER: _ClassVar[int]
    auth_method_name: str
    auth_data: bytes
    def __init__(self, auth_method_name: _Optional[str] = ..., auth_data: _Optional[bytes] = ...) -> None: ...

class KeySharedMeta(_message.Message):
    __slots__ = ("keySharedMode", "hashRanges", "allowOutOfOrderDelivery", "entryBucketDispatch")
    KEYSHAREDMODE_FIELD_NUMBER: _ClassVar[int]
    HASHRANGES_FIELD_NUMBER: _ClassVar[int]
    ALLOWOUTOFORDERDELIVERY_FIELD_NUMBER: _ClassVar[int]
    ENTRYBUCKETDISPATCH_FIELD_NUMBER: _ClassVar[int]
    keySharedMode: KeySharedMode
    hashRanges: _containers.RepeatedCompositeFieldContainer[IntRange]
    allowOutOfOrderDelivery: bool
    entryBucketDispatch: bool
    def __init__(self, keySharedMode: _Optional[_Union[KeySharedMode, str]] = ..., hashRanges: _Optional[_Iterable[_Union[IntRange, _Mapping]]] = ..., allowOutOfOrderDelivery: _Optional[bool] = ..., entryBucketDispatch: _Optional[bool] = ...) -> None: ...

class CommandSubscribe(_message.Message):
    __slots__ = ("topic", "subscription", "subType", "consumer_id", "request_id", "consumer_name", "priority_level", "durable", "start_message_id", "metadata", "read_compacted", "schema", "initialPosition", "replicate_subscription_state", "force_topic_creation", "start_message_rollback_duration_sec", "keySharedMeta", "subscription_properties", "consumer_epoch")
    class SubType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        Exclusive: _ClassVar[CommandSubscribe.SubType]
        Shared: _ClassVar[CommandSubscribe.SubType]
        Failover: _ClassVar[CommandSubscribe.SubType]
        Key_Shared: _ClassVar[CommandSubscribe.SubType]
    Exclusive: CommandSubscribe.SubType
    Shared: CommandSubscribe.SubType
    Failover: CommandSubscribe.SubType
    Key_Shared: CommandSubscribe.SubType
    class InitialPosition(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        Latest: _ClassVar[CommandSubscribe.InitialPosition]
        Earliest: _ClassVar[CommandSubscribe.InitialPosition]
    Latest: CommandSubscribe.InitialPosition
    Earliest: CommandSubscribe.InitialPosition
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SUBTYPE_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NAME_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_LEVEL_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    START_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    READ_COMPACTED_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    INITIALPOSITION_FIELD_NUMBER: _ClassVar[int]
    REPLICATE_SUBSCRIPTION_STATE_FIELD_NUMBER: _ClassVar[int]
    FORCE_TOPIC_CREATION_FIELD_NUMBER: _ClassVar[int]
    START_MESSAGE_ROLLBACK_DURATION_SEC_FIELD_NUMBER: _ClassVar[int]
    KEYSHAREDMETA_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    topic: str
    subscription: str
    subType: CommandSubscribe.SubType
    consumer_id: int
    request_id: int
    consumer_name: str
    priority_level: int
    durable: bool
    start_message_id: MessageIdData
    metadata: _containers.RepeatedCompositeFieldContainer[KeyValue]
    read_compacted: bool
    schema: Schema
    initialPosition: CommandSubscribe.InitialPosition
    replicate_subscription_state: bool
    force_topic_creation: bool
    start_message_rollback_duration_sec: int
    keySharedMeta: KeySharedMeta
    subscription_properties: _containers.RepeatedCompositeFieldContainer[KeyValue]
    consumer_epoch: int
    def __init__(self, topic: _Optional[str] = ..., subscription: _Optional[str] = ..., subType: _Optional[_Union[CommandSubscribe.SubType, str]] = ..., consumer_id: _Optional[int] = ..., request_id: _Optional[int] = ..., consumer_name: _Optional[str] = ..., priority_level: _Optional[int] = ..., durable: _Optional[bool] = ..., start_message_id: _Optional[_Union[MessageIdData, _Mapping]] = ..., metadata: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., read_compacted: _Optional[bool] = ..., schema: _Optional[_Union[Schema, _Mapping]] = ..., initialPosition: _Optional[_Union[CommandSubscribe.InitialPosition, str]] = ..., replicate_subscription_state: _Optional[bool] = ..., force_topic_creation: _Optional[bool] = ..., start_message_rollback_duration_sec: _Optional[int] = ..., keySharedMeta: _Optional[_Union[KeySharedMeta, _Mapping]] = ..., subscription_properties: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., consumer_epoch: _Optional[int] = ...) -> None: ...

class CommandPartitionedTopicMetadata(_message.Message):
    __slots__ = ("topic", "request_id", "original_principal", "original_auth_data", "original_auth_method", "metadata_auto_creation_enabled")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_AUTH_DATA_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_AUTH_METHOD_FIELD_NUMBER: _ClassVar[int]
    METADATA_AUTO_CREATION_ENABLED_FIELD_NUMBER: _ClassVar[int]
    topic: str
    request_id: int
    original_principal: str
    original_auth_data: str
    original_auth_method: str
    metadata_auto_creation_enabled: bool
    def __init__(self, topic: _Optional[str] = ..., request_id: _Optional[int] = ..., original_principal: _Optional[str] = ..., original_auth_data: _Optional[str] = ..., original_auth_method: _Optional[str] = ..., metadata_auto_creation_enabled: _Optional[bool] = ...) -> None: ...

class CommandPartitionedTopicMetadataResponse(_message.Message):
    __slots__ = ("partitions", "request_id", "response", "error", "message")
    class LookupType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        Success: _ClassVar[CommandPartitionedTopicMetadataResponse.LookupType]
        Failed: _ClassVar[CommandPartitionedTopicMetadataResponse.LookupType]
    Success: CommandPartitionedTopicMetadataResponse.LookupType
    Failed: CommandPartitionedTopicMetadataResponse.LookupType
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    partitions: int
    request_id: int
    response: CommandPartitionedTopicMetadataResponse.LookupType
    error: ServerError
    message: str
    def __init__(self, partitions: _Optional[int] = ..., request_id: _Optional[int] = ..., response: _Optional[_Union[CommandPartitionedTopicMetadataResponse.LookupType, str]] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandLookupTopic(_message.Message):
    __slots__ = ("topic", "request_id", "authoritative", "original_principal", "original_auth_data", "original_auth_method", "advertised_listener_name", "properties")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AUTHORITATIVE_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_AUTH_DATA_FIELD_NUMBER: _ClassVar[int]
    ORIGINAL_AUTH_METHOD_FIELD_NUMBER: _ClassVar[int]
    ADVERTISED_LISTENER_NAME_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    topic: str
    request_id: int
    authoritative: bool
    original_principal: str
    original_auth_data: str
    original_auth_method: str
    advertised_listener_name: str
    properties: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, topic: _Optional[str] = ..., request_id: _Optional[int] = ..., authoritative: _Optional[bool] = ..., original_principal: _Optional[str] = ..., original_auth_data: _Optional[str] = ..., original_auth_method: _Optional[str] = ..., advertised_listener_name: _Optional[str] = ..., properties: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class CommandLookupTopicResponse(_message.Message):
    __slots__ = ("brokerServiceUrl", "brokerServiceUrlTls", "response", "request_id", "authoritative", "error", "message", "proxy_through_service_url")
    class LookupType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        Redirect: _ClassVar[CommandLookupTopicResponse.LookupType]
        Connect: _ClassVar[CommandLookupTopicResponse.LookupType]
        Failed: _ClassVar[CommandLookupTopicResponse.LookupType]
    Redirect: CommandLookupTopicResponse.LookupType
    Connect: CommandLookupTopicResponse.LookupType
    Failed: CommandLookupTopicResponse.LookupType
    BROKERSERVICEURL_FIELD_NUMBER: _ClassVar[int]
    BROKERSERVICEURLTLS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    AUTHORITATIVE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PROXY_THROUGH_SERVICE_URL_FIELD_NUMBER: _ClassVar[int]
    brokerServiceUrl: str
    brokerServiceUrlTls: str
    response: CommandLookupTopicResponse.LookupType
    request_id: int
    authoritative: bool
    error: ServerError
    message: str
    proxy_through_service_url: bool
    def __init__(self, brokerServiceUrl: _Optional[str] = ..., brokerServiceUrlTls: _Optional[str] = ..., response: _Optional[_Union[CommandLookupTopicResponse.LookupType, str]] = ..., request_id: _Optional[int] = ..., authoritative: _Optional[bool] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ..., proxy_through_service_url: _Optional[bool] = ...) -> None: ...

class CommandProducer(_message.Message):
    __slots__ = ("topic", "producer_id", "request_id", "producer_name", "encrypted", "metadata", "schema", "epoch", "user_provided_producer_name", "producer_access_mode", "topic_epoch", "txn_enabled", "initial_subscription_name")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_NAME_FIELD_NUMBER: _ClassVar[int]
    ENCRYPTED_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    USER_PROVIDED_PRODUCER_NAME_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_ACCESS_MODE_FIELD_NUMBER: _ClassVar[int]
    TOPIC_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TXN_ENABLED_FIELD_NUMBER: _ClassVar[int]
    INITIAL_SUBSCRIPTION_NAME_FIELD_NUMBER: _ClassVar[int]
    topic: str
    producer_id: int
    request_id: int
    producer_name: str
    encrypted: bool
    metadata: _containers.RepeatedCompositeFieldContainer[KeyValue]
    schema: Schema
    epoch: int
    user_provided_producer_name: bool
    producer_access_mode: ProducerAccessMode
    topic_epoch: int
    txn_enabled: bool
    initial_subscription_name: str
    def __init__(self, topic: _Optional[str] = ..., producer_id: _Optional[int] = ..., request_id: _Optional[int] = ..., producer_name: _Optional[str] = ..., encrypted: _Optional[bool] = ..., metadata: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., schema: _Optional[_Union[Schema, _Mapping]] = ..., epoch: _Optional[int] = ..., user_provided_producer_name: _Optional[bool] = ..., producer_access_mode: _Optional[_Union[ProducerAccessMode, str]] = ..., topic_epoch: _Optional[int] = ..., txn_enabled: _Optional[bool] = ..., initial_subscription_name: _Optional[str] = ...) -> None: ...

class CommandSend(_message.Message):
    __slots__ = ("producer_id", "sequence_id", "num_messages", "txnid_least_bits", "txnid_most_bits", "highest_sequence_id", "is_chunk", "marker", "message_id")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    IS_CHUNK_FIELD_NUMBER: _ClassVar[int]
    MARKER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    sequence_id: int
    num_messages: int
    txnid_least_bits: int
    txnid_most_bits: int
    highest_sequence_id: int
    is_chunk: bool
    marker: bool
    message_id: MessageIdData
    def __init__(self, producer_id: _Optional[int] = ..., sequence_id: _Optional[int] = ..., num_messages: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., highest_sequence_id: _Optional[int] = ..., is_chunk: _Optional[bool] = ..., marker: _Optional[bool] = ..., message_id: _Optional[_Union[MessageIdData, _Mapping]] = ...) -> None: ...

class CommandSendReceipt(_message.Message):
    __slots__ = ("producer_id", "sequence_id", "message_id", "highest_sequence_id")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    HIGHEST_SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    sequence_id: int
    message_id: MessageIdData
    highest_sequence_id: int
    def __init__(self, producer_id: _Optional[int] = ..., sequence_id: _Optional[int] = ..., message_id: _Optional[_Union[MessageIdData, _Mapping]] = ..., highest_sequence_id: _Optional[int] = ...) -> None: ...

class CommandSendError(_message.Message):
    __slots__ = ("producer_id", "sequence_id", "error", "message")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    sequence_id: int
    error: ServerError
    message: str
    def __init__(self, producer_id: _Optional[int] = ..., sequence_id: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandMessage(_message.Message):
    __slots__ = ("consumer_id", "message_id", "redelivery_count", "ack_set", "consumer_epoch")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REDELIVERY_COUNT_FIELD_NUMBER: _ClassVar[int]
    ACK_SET_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    message_id: MessageIdData
    redelivery_count: int
    ack_set: _containers.RepeatedScalarFieldContainer[int]
    consumer_epoch: int
    def __init__(self, consumer_id: _Optional[int] = ..., message_id: _Optional[_Union[MessageIdData, _Mapping]] = ..., redelivery_count: _Optional[int] = ..., ack_set: _Optional[_Iterable[int]] = ..., consumer_epoch: _Optional[int] = ...) -> None: ...

class CommandAck(_message.Message):
    __slots__ = ("consumer_id", "ack_type", "message_id", "validation_error", "properties", "txnid_least_bits", "txnid_most_bits", "request_id")
    class AckType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        Individual: _ClassVar[CommandAck.AckType]
        Cumulative: _ClassVar[CommandAck.AckType]
    Individual: CommandAck.AckType
    Cumulative: CommandAck.AckType
    class ValidationError(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        UncompressedSizeCorruption: _ClassVar[CommandAck.ValidationError]
        DecompressionError: _ClassVar[CommandAck.ValidationError]
        ChecksumMismatch: _ClassVar[CommandAck.ValidationError]
        BatchDeSerializeError: _ClassVar[CommandAck.ValidationError]
        DecryptionError: _ClassVar[CommandAck.ValidationError]
    UncompressedSizeCorruption: CommandAck.ValidationError
    DecompressionError: CommandAck.ValidationError
    ChecksumMismatch: CommandAck.ValidationError
    BatchDeSerializeError: CommandAck.ValidationError
    DecryptionError: CommandAck.ValidationError
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    ACK_TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_ERROR_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    ack_type: CommandAck.AckType
    message_id: _containers.RepeatedCompositeFieldContainer[MessageIdData]
    validation_error: CommandAck.ValidationError
    properties: _containers.RepeatedCompositeFieldContainer[KeyLongValue]
    txnid_least_bits: int
    txnid_most_bits: int
    request_id: int
    def __init__(self, consumer_id: _Optional[int] = ..., ack_type: _Optional[_Union[CommandAck.AckType, str]] = ..., message_id: _Optional[_Iterable[_Union[MessageIdData, _Mapping]]] = ..., validation_error: _Optional[_Union[CommandAck.ValidationError, str]] = ..., properties: _Optional[_Iterable[_Union[KeyLongValue, _Mapping]]] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class CommandAckResponse(_message.Message):
    __slots__ = ("consumer_id", "txnid_least_bits", "txnid_most_bits", "error", "message", "request_id")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    error: ServerError
    message: str
    request_id: int
    def __init__(self, consumer_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ..., request_id: _Optional[int] = ...) -> None: ...

class CommandActiveConsumerChange(_message.Message):
    __slots__ = ("consumer_id", "is_active")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    IS_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    is_active: bool
    def __init__(self, consumer_id: _Optional[int] = ..., is_active: _Optional[bool] = ...) -> None: ...

class CommandFlow(_message.Message):
    __slots__ = ("consumer_id", "messagePermits")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGEPERMITS_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    messagePermits: int
    def __init__(self, consumer_id: _Optional[int] = ..., messagePermits: _Optional[int] = ...) -> None: ...

class CommandUnsubscribe(_message.Message):
    __slots__ = ("consumer_id", "request_id", "force")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    request_id: int
    force: bool
    def __init__(self, consumer_id: _Optional[int] = ..., request_id: _Optional[int] = ..., force: _Optional[bool] = ...) -> None: ...

class CommandSeek(_message.Message):
    __slots__ = ("consumer_id", "request_id", "message_id", "message_publish_time")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_PUBLISH_TIME_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    request_id: int
    message_id: MessageIdData
    message_publish_time: int
    def __init__(self, consumer_id: _Optional[int] = ..., request_id: _Optional[int] = ..., message_id: _Optional[_Union[MessageIdData, _Mapping]] = ..., message_publish_time: _Optional[int] = ...) -> None: ...

class CommandReachedEndOfTopic(_message.Message):
    __slots__ = ("consumer_id",)
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    def __init__(self, consumer_id: _Optional[int] = ...) -> None: ...

class CommandTopicMigrated(_message.Message):
    __slots__ = ("resource_id", "resource_type", "brokerServiceUrl", "brokerServiceUrlTls")
    class ResourceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        Producer: _ClassVar[CommandTopicMigrated.ResourceType]
        Consumer: _ClassVar[CommandTopicMigrated.ResourceType]
    Producer: CommandTopicMigrated.ResourceType
    Consumer: CommandTopicMigrated.ResourceType
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_TYPE_FIELD_NUMBER: _ClassVar[int]
    BROKERSERVICEURL_FIELD_NUMBER: _ClassVar[int]
    BROKERSERVICEURLTLS_FIELD_NUMBER: _ClassVar[int]
    resource_id: int
    resource_type: CommandTopicMigrated.ResourceType
    brokerServiceUrl: str
    brokerServiceUrlTls: str
    def __init__(self, resource_id: _Optional[int] = ..., resource_type: _Optional[_Union[CommandTopicMigrated.ResourceType, str]] = ..., brokerServiceUrl: _Optional[str] = ..., brokerServiceUrlTls: _Optional[str] = ...) -> None: ...

class CommandCloseProducer(_message.Message):
    __slots__ = ("producer_id", "request_id", "assignedBrokerServiceUrl", "assignedBrokerServiceUrlTls")
    PRODUCER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNEDBROKERSERVICEURL_FIELD_NUMBER: _ClassVar[int]
    ASSIGNEDBROKERSERVICEURLTLS_FIELD_NUMBER: _ClassVar[int]
    producer_id: int
    request_id: int
    assignedBrokerServiceUrl: str
    assignedBrokerServiceUrlTls: str
    def __init__(self, producer_id: _Optional[int] = ..., request_id: _Optional[int] = ..., assignedBrokerServiceUrl: _Optional[str] = ..., assignedBrokerServiceUrlTls: _Optional[str] = ...) -> None: ...

class CommandCloseConsumer(_message.Message):
    __slots__ = ("consumer_id", "request_id", "assignedBrokerServiceUrl", "assignedBrokerServiceUrlTls")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNEDBROKERSERVICEURL_FIELD_NUMBER: _ClassVar[int]
    ASSIGNEDBROKERSERVICEURLTLS_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    request_id: int
    assignedBrokerServiceUrl: str
    assignedBrokerServiceUrlTls: str
    def __init__(self, consumer_id: _Optional[int] = ..., request_id: _Optional[int] = ..., assignedBrokerServiceUrl: _Optional[str] = ..., assignedBrokerServiceUrlTls: _Optional[str] = ...) -> None: ...

class CommandRedeliverUnacknowledgedMessages(_message.Message):
    __slots__ = ("consumer_id", "message_ids", "consumer_epoch")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    message_ids: _containers.RepeatedCompositeFieldContainer[MessageIdData]
    consumer_epoch: int
    def __init__(self, consumer_id: _Optional[int] = ..., message_ids: _Optional[_Iterable[_Union[MessageIdData, _Mapping]]] = ..., consumer_epoch: _Optional[int] = ...) -> None: ...

class CommandSuccess(_message.Message):
    __slots__ = ("request_id", "schema")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    schema: Schema
    def __init__(self, request_id: _Optional[int] = ..., schema: _Optional[_Union[Schema, _Mapping]] = ...) -> None: ...

class CommandProducerSuccess(_message.Message):
    __slots__ = ("request_id", "producer_name", "last_sequence_id", "schema_version", "topic_epoch", "producer_ready")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_NAME_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQUENCE_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOPIC_EPOCH_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_READY_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    producer_name: str
    last_sequence_id: int
    schema_version: bytes
    topic_epoch: int
    producer_ready: bool
    def __init__(self, request_id: _Optional[int] = ..., producer_name: _Optional[str] = ..., last_sequence_id: _Optional[int] = ..., schema_version: _Optional[bytes] = ..., topic_epoch: _Optional[int] = ..., producer_ready: _Optional[bool] = ...) -> None: ...

class CommandError(_message.Message):
    __slots__ = ("request_id", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandPing(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommandPong(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommandConsumerStats(_message.Message):
    __slots__ = ("request_id", "consumer_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    consumer_id: int
    def __init__(self, request_id: _Optional[int] = ..., consumer_id: _Optional[int] = ...) -> None: ...

class CommandConsumerStatsResponse(_message.Message):
    __slots__ = ("request_id", "error_code", "error_message", "msgRateOut", "msgThroughputOut", "msgRateRedeliver", "consumerName", "availablePermits", "unackedMessages", "blockedConsumerOnUnackedMsgs", "address", "connectedSince", "type", "msgRateExpired", "msgBacklog", "messageAckRate")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    MSGRATEOUT_FIELD_NUMBER: _ClassVar[int]
    MSGTHROUGHPUTOUT_FIELD_NUMBER: _ClassVar[int]
    MSGRATEREDELIVER_FIELD_NUMBER: _ClassVar[int]
    CONSUMERNAME_FIELD_NUMBER: _ClassVar[int]
    AVAILABLEPERMITS_FIELD_NUMBER: _ClassVar[int]
    UNACKEDMESSAGES_FIELD_NUMBER: _ClassVar[int]
    BLOCKEDCONSUMERONUNACKEDMSGS_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONNECTEDSINCE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MSGRATEEXPIRED_FIELD_NUMBER: _ClassVar[int]
    MSGBACKLOG_FIELD_NUMBER: _ClassVar[int]
    MESSAGEACKRATE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error_code: ServerError
    error_message: str
    msgRateOut: float
    msgThroughputOut: float
    msgRateRedeliver: float
    consumerName: str
    availablePermits: int
    unackedMessages: int
    blockedConsumerOnUnackedMsgs: bool
    address: str
    connectedSince: str
    type: str
    msgRateExpired: float
    msgBacklog: int
    messageAckRate: float
    def __init__(self, request_id: _Optional[int] = ..., error_code: _Optional[_Union[ServerError, str]] = ..., error_message: _Optional[str] = ..., msgRateOut: _Optional[float] = ..., msgThroughputOut: _Optional[float] = ..., msgRateRedeliver: _Optional[float] = ..., consumerName: _Optional[str] = ..., availablePermits: _Optional[int] = ..., unackedMessages: _Optional[int] = ..., blockedConsumerOnUnackedMsgs: _Optional[bool] = ..., address: _Optional[str] = ..., connectedSince: _Optional[str] = ..., type: _Optional[str] = ..., msgRateExpired: _Optional[float] = ..., msgBacklog: _Optional[int] = ..., messageAckRate: _Optional[float] = ...) -> None: ...

class CommandGetLastMessageId(_message.Message):
    __slots__ = ("consumer_id", "request_id")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    request_id: int
    def __init__(self, consumer_id: _Optional[int] = ..., request_id: _Optional[int] = ...) -> None: ...

class CommandGetLastMessageIdResponse(_message.Message):
    __slots__ = ("last_message_id", "request_id", "consumer_mark_delete_position")
    LAST_MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_MARK_DELETE_POSITION_FIELD_NUMBER: _ClassVar[int]
    last_message_id: MessageIdData
    request_id: int
    consumer_mark_delete_position: MessageIdData
    def __init__(self, last_message_id: _Optional[_Union[MessageIdData, _Mapping]] = ..., request_id: _Optional[int] = ..., consumer_mark_delete_position: _Optional[_Union[MessageIdData, _Mapping]] = ...) -> None: ...

class CommandGetTopicsOfNamespace(_message.Message):
    __slots__ = ("request_id", "namespace", "mode", "topics_pattern", "topics_hash", "properties")
    class Mode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PERSISTENT: _ClassVar[CommandGetTopicsOfNamespace.Mode]
        NON_PERSISTENT: _ClassVar[CommandGetTopicsOfNamespace.Mode]
        ALL: _ClassVar[CommandGetTopicsOfNamespace.Mode]
    PERSISTENT: CommandGetTopicsOfNamespace.Mode
    NON_PERSISTENT: CommandGetTopicsOfNamespace.Mode
    ALL: CommandGetTopicsOfNamespace.Mode
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    TOPICS_PATTERN_FIELD_NUMBER: _ClassVar[int]
    TOPICS_HASH_FIELD_NUMBER: _ClassVar[int]
    PROPERTIES_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    namespace: str
    mode: CommandGetTopicsOfNamespace.Mode
    topics_pattern: str
    topics_hash: str
    properties: _containers.RepeatedCompositeFieldContainer[KeyValue]
    def __init__(self, request_id: _Optional[int] = ..., namespace: _Optional[str] = ..., mode: _Optional[_Union[CommandGetTopicsOfNamespace.Mode, str]] = ..., topics_pattern: _Optional[str] = ..., topics_hash: _Optional[str] = ..., properties: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ...) -> None: ...

class CommandGetTopicsOfNamespaceResponse(_message.Message):
    __slots__ = ("request_id", "topics", "filtered", "topics_hash", "changed")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    FILTERED_FIELD_NUMBER: _ClassVar[int]
    TOPICS_HASH_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    topics: _containers.RepeatedScalarFieldContainer[str]
    filtered: bool
    topics_hash: str
    changed: bool
    def __init__(self, request_id: _Optional[int] = ..., topics: _Optional[_Iterable[str]] = ..., filtered: _Optional[bool] = ..., topics_hash: _Optional[str] = ..., changed: _Optional[bool] = ...) -> None: ...

class CommandWatchTopicList(_message.Message):
    __slots__ = ("request_id", "watcher_id", "namespace", "topics_pattern", "topics_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    TOPICS_PATTERN_FIELD_NUMBER: _ClassVar[int]
    TOPICS_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    watcher_id: int
    namespace: str
    topics_pattern: str
    topics_hash: str
    def __init__(self, request_id: _Optional[int] = ..., watcher_id: _Optional[int] = ..., namespace: _Optional[str] = ..., topics_pattern: _Optional[str] = ..., topics_hash: _Optional[str] = ...) -> None: ...

class CommandWatchTopicListSuccess(_message.Message):
    __slots__ = ("request_id", "watcher_id", "topic", "topics_hash")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    TOPICS_HASH_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    watcher_id: int
    topic: _containers.RepeatedScalarFieldContainer[str]
    topics_hash: str
    def __init__(self, request_id: _Optional[int] = ..., watcher_id: _Optional[int] = ..., topic: _Optional[_Iterable[str]] = ..., topics_hash: _Optional[str] = ...) -> None: ...

class CommandWatchTopicUpdate(_message.Message):
    __slots__ = ("watcher_id", "new_topics", "deleted_topics", "topics_hash")
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    NEW_TOPICS_FIELD_NUMBER: _ClassVar[int]
    DELETED_TOPICS_FIELD_NUMBER: _ClassVar[int]
    TOPICS_HASH_FIELD_NUMBER: _ClassVar[int]
    watcher_id: int
    new_topics: _containers.RepeatedScalarFieldContainer[str]
    deleted_topics: _containers.RepeatedScalarFieldContainer[str]
    topics_hash: str
    def __init__(self, watcher_id: _Optional[int] = ..., new_topics: _Optional[_Iterable[str]] = ..., deleted_topics: _Optional[_Iterable[str]] = ..., topics_hash: _Optional[str] = ...) -> None: ...

class CommandWatchTopicListClose(_message.Message):
    __slots__ = ("request_id", "watcher_id")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    WATCHER_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    watcher_id: int
    def __init__(self, request_id: _Optional[int] = ..., watcher_id: _Optional[int] = ...) -> None: ...

class SegmentInfoProto(_message.Message):
    __slots__ = ("segment_id", "hash_start", "hash_end", "state", "parent_ids", "child_ids", "created_at_epoch", "sealed_at_epoch", "created_at_ms", "sealed_at_ms", "legacy_topic_name", "entry_bucket_splits")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_START_FIELD_NUMBER: _ClassVar[int]
    HASH_END_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PARENT_IDS_FIELD_NUMBER: _ClassVar[int]
    CHILD_IDS_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEALED_AT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SEALED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    LEGACY_TOPIC_NAME_FIELD_NUMBER: _ClassVar[int]
    ENTRY_BUCKET_SPLITS_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    hash_start: int
    hash_end: int
    state: SegmentState
    parent_ids: _containers.RepeatedScalarFieldContainer[int]
    child_ids: _containers.RepeatedScalarFieldContainer[int]
    created_at_epoch: int
    sealed_at_epoch: int
    created_at_ms: int
    sealed_at_ms: int
    legacy_topic_name: str
    entry_bucket_splits: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, segment_id: _Optional[int] = ..., hash_start: _Optional[int] = ..., hash_end: _Optional[int] = ..., state: _Optional[_Union[SegmentState, str]] = ..., parent_ids: _Optional[_Iterable[int]] = ..., child_ids: _Optional[_Iterable[int]] = ..., created_at_epoch: _Optional[int] = ..., sealed_at_epoch: _Optional[int] = ..., created_at_ms: _Optional[int] = ..., sealed_at_ms: _Optional[int] = ..., legacy_topic_name: _Optional[str] = ..., entry_bucket_splits: _Optional[_Iterable[int]] = ...) -> None: ...

class SegmentBrokerAddress(_message.Message):
    __slots__ = ("segment_id", "broker_url", "broker_url_tls")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_URL_FIELD_NUMBER: _ClassVar[int]
    BROKER_URL_TLS_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    broker_url: str
    broker_url_tls: str
    def __init__(self, segment_id: _Optional[int] = ..., broker_url: _Optional[str] = ..., broker_url_tls: _Optional[str] = ...) -> None: ...

class ScalableTopicDAG(_message.Message):
    __slots__ = ("epoch", "segments", "segment_brokers", "controller_broker_url", "controller_broker_url_tls")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_BROKERS_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_BROKER_URL_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_BROKER_URL_TLS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    segments: _containers.RepeatedCompositeFieldContainer[SegmentInfoProto]
    segment_brokers: _containers.RepeatedCompositeFieldContainer[SegmentBrokerAddress]
    controller_broker_url: str
    controller_broker_url_tls: str
    def __init__(self, epoch: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[SegmentInfoProto, _Mapping]]] = ..., segment_brokers: _Optional[_Iterable[_Union[SegmentBrokerAddress, _Mapping]]] = ..., controller_broker_url: _Optional[str] = ..., controller_broker_url_tls: _Optional[str] = ...) -> None: ...

class CommandScalableTopicLookup(_message.Message):
    __slots__ = ("session_id", "topic", "create_if_missing")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    CREATE_IF_MISSING_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    topic: str
    create_if_missing: bool
    def __init__(self, session_id: _Optional[int] = ..., topic: _Optional[str] = ..., create_if_missing: _Optional[bool] = ...) -> None: ...

class CommandScalableTopicUpdate(_message.Message):
    __slots__ = ("session_id", "dag", "error", "message", "resolved_topic_name")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DAG_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RESOLVED_TOPIC_NAME_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    dag: ScalableTopicDAG
    error: ServerError
    message: str
    resolved_topic_name: str
    def __init__(self, session_id: _Optional[int] = ..., dag: _Optional[_Union[ScalableTopicDAG, _Mapping]] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ..., resolved_topic_name: _Optional[str] = ...) -> None: ...

class CommandScalableTopicClose(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: int
    def __init__(self, session_id: _Optional[int] = ...) -> None: ...

class ScalableAssignedSegment(_message.Message):
    __slots__ = ("segment_id", "hash_start", "hash_end", "segment_topic", "bucket_ranges")
    SEGMENT_ID_FIELD_NUMBER: _ClassVar[int]
    HASH_START_FIELD_NUMBER: _ClassVar[int]
    HASH_END_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_TOPIC_FIELD_NUMBER: _ClassVar[int]
    BUCKET_RANGES_FIELD_NUMBER: _ClassVar[int]
    segment_id: int
    hash_start: int
    hash_end: int
    segment_topic: str
    bucket_ranges: _containers.RepeatedCompositeFieldContainer[IntRange]
    def __init__(self, segment_id: _Optional[int] = ..., hash_start: _Optional[int] = ..., hash_end: _Optional[int] = ..., segment_topic: _Optional[str] = ..., bucket_ranges: _Optional[_Iterable[_Union[IntRange, _Mapping]]] = ...) -> None: ...

class ScalableConsumerAssignment(_message.Message):
    __slots__ = ("layout_epoch", "segments")
    LAYOUT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    layout_epoch: int
    segments: _containers.RepeatedCompositeFieldContainer[ScalableAssignedSegment]
    def __init__(self, layout_epoch: _Optional[int] = ..., segments: _Optional[_Iterable[_Union[ScalableAssignedSegment, _Mapping]]] = ...) -> None: ...

class CommandScalableTopicSubscribe(_message.Message):
    __slots__ = ("request_id", "topic", "subscription", "consumer_name", "consumer_id", "consumer_type")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_NAME_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_TYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    topic: str
    subscription: str
    consumer_name: str
    consumer_id: int
    consumer_type: ScalableConsumerType
    def __init__(self, request_id: _Optional[int] = ..., topic: _Optional[str] = ..., subscription: _Optional[str] = ..., consumer_name: _Optional[str] = ..., consumer_id: _Optional[int] = ..., consumer_type: _Optional[_Union[ScalableConsumerType, str]] = ...) -> None: ...

class CommandScalableTopicSubscribeResponse(_message.Message):
    __slots__ = ("request_id", "error", "message", "assignment")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: ServerError
    message: str
    assignment: ScalableConsumerAssignment
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ..., assignment: _Optional[_Union[ScalableConsumerAssignment, _Mapping]] = ...) -> None: ...

class CommandScalableTopicAssignmentUpdate(_message.Message):
    __slots__ = ("consumer_id", "assignment")
    CONSUMER_ID_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENT_FIELD_NUMBER: _ClassVar[int]
    consumer_id: int
    assignment: ScalableConsumerAssignment
    def __init__(self, consumer_id: _Optional[int] = ..., assignment: _Optional[_Union[ScalableConsumerAssignment, _Mapping]] = ...) -> None: ...

class CommandWatchScalableTopics(_message.Message):
    __slots__ = ("watch_id", "namespace", "property_filters", "current_hash")
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PROPERTY_FILTERS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_HASH_FIELD_NUMBER: _ClassVar[int]
    watch_id: int
    namespace: str
    property_filters: _containers.RepeatedCompositeFieldContainer[KeyValue]
    current_hash: str
    def __init__(self, watch_id: _Optional[int] = ..., namespace: _Optional[str] = ..., property_filters: _Optional[_Iterable[_Union[KeyValue, _Mapping]]] = ..., current_hash: _Optional[str] = ...) -> None: ...

class ScalableTopicsSnapshot(_message.Message):
    __slots__ = ("topics",)
    TOPICS_FIELD_NUMBER: _ClassVar[int]
    topics: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, topics: _Optional[_Iterable[str]] = ...) -> None: ...

class ScalableTopicsDiff(_message.Message):
    __slots__ = ("added", "removed")
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    added: _containers.RepeatedScalarFieldContainer[str]
    removed: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, added: _Optional[_Iterable[str]] = ..., removed: _Optional[_Iterable[str]] = ...) -> None: ...

class CommandWatchScalableTopicsUpdate(_message.Message):
    __slots__ = ("watch_id", "snapshot", "diff", "error", "message")
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    DIFF_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    watch_id: int
    snapshot: ScalableTopicsSnapshot
    diff: ScalableTopicsDiff
    error: ServerError
    message: str
    def __init__(self, watch_id: _Optional[int] = ..., snapshot: _Optional[_Union[ScalableTopicsSnapshot, _Mapping]] = ..., diff: _Optional[_Union[ScalableTopicsDiff, _Mapping]] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandWatchScalableTopicsClose(_message.Message):
    __slots__ = ("watch_id",)
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    watch_id: int
    def __init__(self, watch_id: _Optional[int] = ...) -> None: ...

class CommandWatchTcAssignments(_message.Message):
    __slots__ = ("watch_id",)
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    watch_id: int
    def __init__(self, watch_id: _Optional[int] = ...) -> None: ...

class TcAssignment(_message.Message):
    __slots__ = ("tc_id", "broker_service_url", "broker_service_url_tls")
    TC_ID_FIELD_NUMBER: _ClassVar[int]
    BROKER_SERVICE_URL_FIELD_NUMBER: _ClassVar[int]
    BROKER_SERVICE_URL_TLS_FIELD_NUMBER: _ClassVar[int]
    tc_id: int
    broker_service_url: str
    broker_service_url_tls: str
    def __init__(self, tc_id: _Optional[int] = ..., broker_service_url: _Optional[str] = ..., broker_service_url_tls: _Optional[str] = ...) -> None: ...

class TcAssignmentsSnapshot(_message.Message):
    __slots__ = ("parallelism", "assignments")
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    ASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    parallelism: int
    assignments: _containers.RepeatedCompositeFieldContainer[TcAssignment]
    def __init__(self, parallelism: _Optional[int] = ..., assignments: _Optional[_Iterable[_Union[TcAssignment, _Mapping]]] = ...) -> None: ...

class CommandWatchTcAssignmentsUpdate(_message.Message):
    __slots__ = ("watch_id", "snapshot", "error", "message")
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    watch_id: int
    snapshot: TcAssignmentsSnapshot
    error: ServerError
    message: str
    def __init__(self, watch_id: _Optional[int] = ..., snapshot: _Optional[_Union[TcAssignmentsSnapshot, _Mapping]] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandWatchTcAssignmentsClose(_message.Message):
    __slots__ = ("watch_id",)
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    watch_id: int
    def __init__(self, watch_id: _Optional[int] = ...) -> None: ...

class CommandGetSchema(_message.Message):
    __slots__ = ("request_id", "topic", "schema_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    topic: str
    schema_version: bytes
    def __init__(self, request_id: _Optional[int] = ..., topic: _Optional[str] = ..., schema_version: _Optional[bytes] = ...) -> None: ...

class CommandGetSchemaResponse(_message.Message):
    __slots__ = ("request_id", "error_code", "error_message", "schema", "schema_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error_code: ServerError
    error_message: str
    schema: Schema
    schema_version: bytes
    def __init__(self, request_id: _Optional[int] = ..., error_code: _Optional[_Union[ServerError, str]] = ..., error_message: _Optional[str] = ..., schema: _Optional[_Union[Schema, _Mapping]] = ..., schema_version: _Optional[bytes] = ...) -> None: ...

class CommandGetOrCreateSchema(_message.Message):
    __slots__ = ("request_id", "topic", "schema", "producerName")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    PRODUCERNAME_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    topic: str
    schema: Schema
    producerName: str
    def __init__(self, request_id: _Optional[int] = ..., topic: _Optional[str] = ..., schema: _Optional[_Union[Schema, _Mapping]] = ..., producerName: _Optional[str] = ...) -> None: ...

class CommandGetOrCreateSchemaResponse(_message.Message):
    __slots__ = ("request_id", "error_code", "error_message", "schema_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error_code: ServerError
    error_message: str
    schema_version: bytes
    def __init__(self, request_id: _Optional[int] = ..., error_code: _Optional[_Union[ServerError, str]] = ..., error_message: _Optional[str] = ..., schema_version: _Optional[bytes] = ...) -> None: ...

class CommandTcClientConnectRequest(_message.Message):
    __slots__ = ("request_id", "tc_id", "scalable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TC_ID_FIELD_NUMBER: _ClassVar[int]
    SCALABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    tc_id: int
    scalable: bool
    def __init__(self, request_id: _Optional[int] = ..., tc_id: _Optional[int] = ..., scalable: _Optional[bool] = ...) -> None: ...

class CommandTcClientConnectResponse(_message.Message):
    __slots__ = ("request_id", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandNewTxn(_message.Message):
    __slots__ = ("request_id", "txn_ttl_millis", "tc_id", "scalable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXN_TTL_MILLIS_FIELD_NUMBER: _ClassVar[int]
    TC_ID_FIELD_NUMBER: _ClassVar[int]
    SCALABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txn_ttl_millis: int
    tc_id: int
    scalable: bool
    def __init__(self, request_id: _Optional[int] = ..., txn_ttl_millis: _Optional[int] = ..., tc_id: _Optional[int] = ..., scalable: _Optional[bool] = ...) -> None: ...

class CommandNewTxnResponse(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandAddPartitionToTxn(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "partitions", "scalable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    PARTITIONS_FIELD_NUMBER: _ClassVar[int]
    SCALABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    partitions: _containers.RepeatedScalarFieldContainer[str]
    scalable: bool
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., partitions: _Optional[_Iterable[str]] = ..., scalable: _Optional[bool] = ...) -> None: ...

class CommandAddPartitionToTxnResponse(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class Subscription(_message.Message):
    __slots__ = ("topic", "subscription")
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    topic: str
    subscription: str
    def __init__(self, topic: _Optional[str] = ..., subscription: _Optional[str] = ...) -> None: ...

class CommandAddSubscriptionToTxn(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "subscription", "scalable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SCALABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    subscription: _containers.RepeatedCompositeFieldContainer[Subscription]
    scalable: bool
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., subscription: _Optional[_Iterable[_Union[Subscription, _Mapping]]] = ..., scalable: _Optional[bool] = ...) -> None: ...

class CommandAddSubscriptionToTxnResponse(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandEndTxn(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "txn_action", "scalable")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXN_ACTION_FIELD_NUMBER: _ClassVar[int]
    SCALABLE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    txn_action: TxnAction
    scalable: bool
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., txn_action: _Optional[_Union[TxnAction, str]] = ..., scalable: _Optional[bool] = ...) -> None: ...

class CommandEndTxnResponse(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandEndTxnOnPartition(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "topic", "txn_action", "txnid_least_bits_of_low_watermark")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    TOPIC_FIELD_NUMBER: _ClassVar[int]
    TXN_ACTION_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_OF_LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    topic: str
    txn_action: TxnAction
    txnid_least_bits_of_low_watermark: int
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., topic: _Optional[str] = ..., txn_action: _Optional[_Union[TxnAction, str]] = ..., txnid_least_bits_of_low_watermark: _Optional[int] = ...) -> None: ...

class CommandEndTxnOnPartitionResponse(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class CommandEndTxnOnSubscription(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "subscription", "txn_action", "txnid_least_bits_of_low_watermark")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    TXN_ACTION_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_OF_LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    subscription: Subscription
    txn_action: TxnAction
    txnid_least_bits_of_low_watermark: int
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., subscription: _Optional[_Union[Subscription, _Mapping]] = ..., txn_action: _Optional[_Union[TxnAction, str]] = ..., txnid_least_bits_of_low_watermark: _Optional[int] = ...) -> None: ...

class CommandEndTxnOnSubscriptionResponse(_message.Message):
    __slots__ = ("request_id", "txnid_least_bits", "txnid_most_bits", "error", "message")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TXNID_LEAST_BITS_FIELD_NUMBER: _ClassVar[int]
    TXNID_MOST_BITS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    txnid_least_bits: int
    txnid_most_bits: int
    error: ServerError
    message: str
    def __init__(self, request_id: _Optional[int] = ..., txnid_least_bits: _Optional[int] = ..., txnid_most_bits: _Optional[int] = ..., error: _Optional[_Union[ServerError, str]] = ..., message: _Optional[str] = ...) -> None: ...

class BaseCommand(_message.Message):
    __slots__ = ("type", "connect", "connected", "subscribe", "producer", "send", "send_receipt", "send_error", "message", "ack", "flow", "unsubscribe", "success", "error", "close_producer", "close_consumer", "producer_success", "ping", "pong", "redeliverUnacknowledgedMessages", "partitionMetadata", "partitionMetadataResponse", "lookupTopic", "lookupTopicResponse", "consumerStats", "consumerStatsResponse", "reachedEndOfTopic", "seek", "getLastMessageId", "getLastMessageIdResponse", "active_consumer_change", "getTopicsOfNamespace", "getTopicsOfNamespaceResponse", "getSchema", "getSchemaResponse", "authChallenge", "authResponse", "ackResponse", "getOrCreateSchema", "getOrCreateSchemaResponse", "newTxn", "newTxnResponse", "addPartitionToTxn", "addPartitionToTxnResponse", "addSubscriptionToTxn", "addSubscriptionToTxnResponse", "endTxn", "endTxnResponse", "endTxnOnPartition", "endTxnOnPartitionResponse", "endTxnOnSubscription", "endTxnOnSubscriptionResponse", "tcClientConnectRequest", "tcClientConnectResponse", "watchTopicList", "watchTopicListSuccess", "watchTopicUpdate", "watchTopicListClose", "topicMigrated", "scalableTopicLookup", "scalableTopicUpdate", "scalableTopicClose", "scalableTopicSubscribe", "scalableTopicSubscribeResponse", "scalableTopicAssignmentUpdate", "watchScalableTopics", "watchScalableTopicsUpdate", "watchScalableTopicsClose", "watchTcAssignments", "watchTcAssignmentsUpdate", "watchTcAssignmentsClose")
    class Type(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CONNECT: _ClassVar[BaseCommand.Type]
        CONNECTED: _ClassVar[BaseCommand.Type]
        SUBSCRIBE: _ClassVar[BaseCommand.Type]
        PRODUCER: _ClassVar[BaseCommand.Type]
        SEND: _ClassVar[BaseCommand.Type]
        SEND_RECEIPT: _ClassVar[BaseCommand.Type]
        SEND_ERROR: _ClassVar[BaseCommand.Type]
        MESSAGE: _ClassVar[BaseCommand.Type]
        ACK: _ClassVar[BaseCommand.Type]
        FLOW: _ClassVar[BaseCommand.Type]
        UNSUBSCRIBE: _ClassVar[BaseCommand.Type]
        SUCCESS: _ClassVar[BaseCommand.Type]
        ERROR: _ClassVar[BaseCommand.Type]
        CLOSE_PRODUCER: _ClassVar[BaseCommand.Type]
        CLOSE_CONSUMER: _ClassVar[BaseCommand.Type]
        PRODUCER_SUCCESS: _ClassVar[BaseCommand.Type]
        PING: _ClassVar[BaseCommand.Type]
        PONG: _ClassVar[BaseCommand.Type]
        REDELIVER_UNACKNOWLEDGED_MESSAGES: _ClassVar[BaseCommand.Type]
        PARTITIONED_METADATA: _ClassVar[BaseCommand.Type]
        PARTITIONED_METADATA_RESPONSE: _ClassVar[BaseCommand.Type]
        LOOKUP: _ClassVar[BaseCommand.Type]
        LOOKUP_RESPONSE: _ClassVar[BaseCommand.Type]
        CONSUMER_STATS: _ClassVar[BaseCommand.Type]
        CONSUMER_STATS_RESPONSE: _ClassVar[BaseCommand.Type]
        REACHED_END_OF_TOPIC: _ClassVar[BaseCommand.Type]
        SEEK: _ClassVar[BaseCommand.Type]
        GET_LAST_MESSAGE_ID: _ClassVar[BaseCommand.Type]
        GET_LAST_MESSAGE_ID_RESPONSE: _ClassVar[BaseCommand.Type]
        ACTIVE_CONSUMER_CHANGE: _ClassVar[BaseCommand.Type]
        GET_TOPICS_OF_NAMESPACE: _ClassVar[BaseCommand.Type]
        GET_TOPICS_OF_NAMESPACE_RESPONSE: _ClassVar[BaseCommand.Type]
        GET_SCHEMA: _ClassVar[BaseCommand.Type]
        GET_SCHEMA_RESPONSE: _ClassVar[BaseCommand.Type]
        AUTH_CHALLENGE: _ClassVar[BaseCommand.Type]
        AUTH_RESPONSE: _ClassVar[BaseCommand.Type]
        ACK_RESPONSE: _ClassVar[BaseCommand.Type]
        GET_OR_CREATE_SCHEMA: _ClassVar[BaseCommand.Type]
        GET_OR_CREATE_SCHEMA_RESPONSE: _ClassVar[BaseCommand.Type]
        NEW_TXN: _ClassVar[BaseCommand.Type]
        NEW_TXN_RESPONSE: _ClassVar[BaseCommand.Type]
        ADD_PARTITION_TO_TXN: _ClassVar[BaseCommand.Type]
        ADD_PARTITION_TO_TXN_RESPONSE: _ClassVar[BaseCommand.Type]
        ADD_SUBSCRIPTION_TO_TXN: _ClassVar[BaseCommand.Type]
        ADD_SUBSCRIPTION_TO_TXN_RESPONSE: _ClassVar[BaseCommand.Type]
        END_TXN: _ClassVar[BaseCommand.Type]
        END_TXN_RESPONSE: _ClassVar[BaseCommand.Type]
        END_TXN_ON_PARTITION: _ClassVar[BaseCommand.Type]
        END_TXN_ON_PARTITION_RESPONSE: _ClassVar[BaseCommand.Type]
        END_TXN_ON_SUBSCRIPTION: _ClassVar[BaseCommand.Type]
        END_TXN_ON_SUBSCRIPTION_RESPONSE: _ClassVar[BaseCommand.Type]
        TC_CLIENT_CONNECT_REQUEST: _ClassVar[BaseCommand.Type]
        TC_CLIENT_CONNECT_RESPONSE: _ClassVar[BaseCommand.Type]
        WATCH_TOPIC_LIST: _ClassVar[BaseCommand.Type]
        WATCH_TOPIC_LIST_SUCCESS: _ClassVar[BaseCommand.Type]
        WATCH_TOPIC_UPDATE: _ClassVar[BaseCommand.Type]
        WATCH_TOPIC_LIST_CLOSE: _ClassVar[BaseCommand.Type]
        TOPIC_MIGRATED: _ClassVar[BaseCommand.Type]
        SCALABLE_TOPIC_LOOKUP: _ClassVar[BaseCommand.Type]
        SCALABLE_TOPIC_UPDATE: _ClassVar[BaseCommand.Type]
        SCALABLE_TOPIC_CLOSE: _ClassVar[BaseCommand.Type]
        SCALABLE_TOPIC_SUBSCRIBE: _ClassVar[BaseCommand.Type]
        SCALABLE_TOPIC_SUBSCRIBE_RESPONSE: _ClassVar[BaseCommand.Type]
        SCALABLE_TOPIC_ASSIGNMENT_UPDATE: _ClassVar[BaseCommand.Type]
        WATCH_SCALABLE_TOPICS: _ClassVar[BaseCommand.Type]
        WATCH_SCALABLE_TOPICS_UPDATE: _ClassVar[BaseCommand.Type]
        WATCH_SCALABLE_TOPICS_CLOSE: _ClassVar[BaseCommand.Type]
        WATCH_TC_ASSIGNMENTS: _ClassVar[BaseCommand.Type]
        WATCH_TC_ASSIGNMENTS_UPDATE: _ClassVar[BaseCommand.Type]
        WATCH_TC_ASSIGNMENTS_CLOSE: _ClassVar[BaseCommand.Type]
    CONNECT: BaseCommand.Type
    CONNECTED: BaseCommand.Type
    SUBSCRIBE: BaseCommand.Type
    PRODUCER: BaseCommand.Type
    SEND: BaseCommand.Type
    SEND_RECEIPT: BaseCommand.Type
    SEND_ERROR: BaseCommand.Type
    MESSAGE: BaseCommand.Type
    ACK: BaseCommand.Type
    FLOW: BaseCommand.Type
    UNSUBSCRIBE: BaseCommand.Type
    SUCCESS: BaseCommand.Type
    ERROR: BaseCommand.Type
    CLOSE_PRODUCER: BaseCommand.Type
    CLOSE_CONSUMER: BaseCommand.Type
    PRODUCER_SUCCESS: BaseCommand.Type
    PING: BaseCommand.Type
    PONG: BaseCommand.Type
    REDELIVER_UNACKNOWLEDGED_MESSAGES: BaseCommand.Type
    PARTITIONED_METADATA: BaseCommand.Type
    PARTITIONED_METADATA_RESPONSE: BaseCommand.Type
    LOOKUP: BaseCommand.Type
    LOOKUP_RESPONSE: BaseCommand.Type
    CONSUMER_STATS: BaseCommand.Type
    CONSUMER_STATS_RESPONSE: BaseCommand.Type
    REACHED_END_OF_TOPIC: BaseCommand.Type
    SEEK: BaseCommand.Type
    GET_LAST_MESSAGE_ID: BaseCommand.Type
    GET_LAST_MESSAGE_ID_RESPONSE: BaseCommand.Type
    ACTIVE_CONSUMER_CHANGE: BaseCommand.Type
    GET_TOPICS_OF_NAMESPACE: BaseCommand.Type
    GET_TOPICS_OF_NAMESPACE_RESPONSE: BaseCommand.Type
    GET_SCHEMA: BaseCommand.Type
    GET_SCHEMA_RESPONSE: BaseCommand.Type
    AUTH_CHALLENGE: BaseCommand.Type
    AUTH_RESPONSE: BaseCommand.Type
    ACK_RESPONSE: BaseCommand.Type
    GET_OR_CREATE_SCHEMA: BaseCommand.Type
    GET_OR_CREATE_SCHEMA_RESPONSE: BaseCommand.Type
    NEW_TXN: BaseCommand.Type
    NEW_TXN_RESPONSE: BaseCommand.Type
    ADD_PARTITION_TO_TXN: BaseCommand.Type
    ADD_PARTITION_TO_TXN_RESPONSE: BaseCommand.Type
    ADD_SUBSCRIPTION_TO_TXN: BaseCommand.Type
    ADD_SUBSCRIPTION_TO_TXN_RESPONSE: BaseCommand.Type
    END_TXN: BaseCommand.Type
    END_TXN_RESPONSE: BaseCommand.Type
    END_TXN_ON_PARTITION: BaseCommand.Type
    END_TXN_ON_PARTITION_RESPONSE: BaseCommand.Type
    END_TXN_ON_SUBSCRIPTION: BaseCommand.Type
    END_TXN_ON_SUBSCRIPTION_RESPONSE: BaseCommand.Type
    TC_CLIENT_CONNECT_REQUEST: BaseCommand.Type
    TC_CLIENT_CONNECT_RESPONSE: BaseCommand.Type
    WATCH_TOPIC_LIST: BaseCommand.Type
    WATCH_TOPIC_LIST_SUCCESS: BaseCommand.Type
    WATCH_TOPIC_UPDATE: BaseCommand.Type
    WATCH_TOPIC_LIST_CLOSE: BaseCommand.Type
    TOPIC_MIGRATED: BaseCommand.Type
    SCALABLE_TOPIC_LOOKUP: BaseCommand.Type
    SCALABLE_TOPIC_UPDATE: BaseCommand.Type
    SCALABLE_TOPIC_CLOSE: BaseCommand.Type
    SCALABLE_TOPIC_SUBSCRIBE: BaseCommand.Type
    SCALABLE_TOPIC_SUBSCRIBE_RESPONSE: BaseCommand.Type
    SCALABLE_TOPIC_ASSIGNMENT_UPDATE: BaseCommand.Type
    WATCH_SCALABLE_TOPICS: BaseCommand.Type
    WATCH_SCALABLE_TOPICS_UPDATE: BaseCommand.Type
    WATCH_SCALABLE_TOPICS_CLOSE: BaseCommand.Type
    WATCH_TC_ASSIGNMENTS: BaseCommand.Type
    WATCH_TC_ASSIGNMENTS_UPDATE: BaseCommand.Type
    WATCH_TC_ASSIGNMENTS_CLOSE: BaseCommand.Type
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CONNECT_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    SUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_FIELD_NUMBER: _ClassVar[int]
    SEND_FIELD_NUMBER: _ClassVar[int]
    SEND_RECEIPT_FIELD_NUMBER: _ClassVar[int]
    SEND_ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    UNSUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    CLOSE_PRODUCER_FIELD_NUMBER: _ClassVar[int]
    CLOSE_CONSUMER_FIELD_NUMBER: _ClassVar[int]
    PRODUCER_SUCCESS_FIELD_NUMBER: _ClassVar[int]
    PING_FIELD_NUMBER: _ClassVar[int]
    PONG_FIELD_NUMBER: _ClassVar[int]
    REDELIVERUNACKNOWLEDGEDMESSAGES_FIELD_NUMBER: _ClassVar[int]
    PARTITIONMETADATA_FIELD_NUMBER: _ClassVar[int]
    PARTITIONMETADATARESPONSE_FIELD_NUMBER: _ClassVar[int]
    LOOKUPTOPIC_FIELD_NUMBER: _ClassVar[int]
    LOOKUPTOPICRESPONSE_FIELD_NUMBER: _ClassVar[int]
    CONSUMERSTATS_FIELD_NUMBER: _ClassVar[int]
    CONSUMERSTATSRESPONSE_FIELD_NUMBER: _ClassVar[int]
    REACHEDENDOFTOPIC_FIELD_NUMBER: _ClassVar[int]
    SEEK_FIELD_NUMBER: _ClassVar[int]
    GETLASTMESSAGEID_FIELD_NUMBER: _ClassVar[int]
    GETLASTMESSAGEIDRESPONSE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_CONSUMER_CHANGE_FIELD_NUMBER: _ClassVar[int]
    GETTOPICSOFNAMESPACE_FIELD_NUMBER: _ClassVar[int]
    GETTOPICSOFNAMESPACERESPONSE_FIELD_NUMBER: _ClassVar[int]
    GETSCHEMA_FIELD_NUMBER: _ClassVar[int]
    GETSCHEMARESPONSE_FIELD_NUMBER: _ClassVar[int]
    AUTHCHALLENGE_FIELD_NUMBER: _ClassVar[int]
    AUTHRESPONSE_FIELD_NUMBER: _ClassVar[int]
    ACKRESPONSE_FIELD_NUMBER: _ClassVar[int]
    GETORCREATESCHEMA_FIELD_NUMBER: _ClassVar[int]
    GETORCREATESCHEMARESPONSE_FIELD_NUMBER: _ClassVar[int]
    NEWTXN_FIELD_NUMBER: _ClassVar[int]
    NEWTXNRESPONSE_FIELD_NUMBER: _ClassVar[int]
    ADDPARTITIONTOTXN_FIELD_NUMBER: _ClassVar[int]
    ADDPARTITIONTOTXNRESPONSE_FIELD_NUMBER: _ClassVar[int]
    ADDSUBSCRIPTIONTOTXN_FIELD_NUMBER: _ClassVar[int]
    ADDSUBSCRIPTIONTOTXNRESPONSE_FIELD_NUMBER: _ClassVar[int]
    ENDTXN_FIELD_NUMBER: _ClassVar[int]
    ENDTXNRESPONSE_FIELD_NUMBER: _ClassVar[int]
    ENDTXNONPARTITION_FIELD_NUMBER: _ClassVar[int]
    ENDTXNONPARTITIONRESPONSE_FIELD_NUMBER: _ClassVar[int]
    ENDTXNONSUBSCRIPTION_FIELD_NUMBER: _ClassVar[int]
    ENDTXNONSUBSCRIPTIONRESPONSE_FIELD_NUMBER: _ClassVar[int]
    TCCLIENTCONNECTREQUEST_FIELD_NUMBER: _ClassVar[int]
    TCCLIENTCONNECTRESPONSE_FIELD_NUMBER: _ClassVar[int]
    WATCHTOPICLIST_FIELD_NUMBER: _ClassVar[int]
    WATCHTOPICLISTSUCCESS_FIELD_NUMBER: _ClassVar[int]
    WATCHTOPICUPDATE_FIELD_NUMBER: _ClassVar[int]
    WATCHTOPICLISTCLOSE_FIELD_NUMBER: _ClassVar[int]
    TOPICMIGRATED_FIELD_NUMBER: _ClassVar[int]
    SCALABLETOPICLOOKUP_FIELD_NUMBER: _ClassVar[int]
    SCALABLETOPICUPDATE_FIELD_NUMBER: _ClassVar[int]
    SCALABLETOPICCLOSE_FIELD_NUMBER: _ClassVar[int]
    SCALABLETOPICSUBSCRIBE_FIELD_NUMBER: _ClassVar[int]
    SCALABLETOPICSUBSCRIBERESPONSE_FIELD_NUMBER: _ClassVar[int]
    SCALABLETOPICASSIGNMENTUPDATE_FIELD_NUMBER: _ClassVar[int]
    WATCHSCALABLETOPICS_FIELD_NUMBER: _ClassVar[int]
    WATCHSCALABLETOPICSUPDATE_FIELD_NUMBER: _ClassVar[int]
    WATCHSCALABLETOPICSCLOSE_FIELD_NUMBER: _ClassVar[int]
    WATCHTCASSIGNMENTS_FIELD_NUMBER: _ClassVar[int]
    WATCHTCASSIGNMENTSUPDATE_FIELD_NUMBER: _ClassVar[int]
    WATCHTCASSIGNMENTSCLOSE_FIELD_NUMBER: _ClassVar[int]
    type: BaseCommand.Type
    connect: CommandConnect
    connected: CommandConnected
    subscribe: CommandSubscribe
    producer: CommandProducer
    send: CommandSend
    send_receipt: CommandSendReceipt
    send_error: CommandSendError
    message: CommandMessage
    ack: CommandAck
    flow: CommandFlow
    unsubscribe: CommandUnsubscribe
    success: CommandSuccess
    error: CommandError
    close_producer: CommandCloseProducer
    close_consumer: CommandCloseConsumer
    producer_success: CommandProducerSuccess
    ping: CommandPing
    pong: CommandPong
    redeliverUnacknowledgedMessages: CommandRedeliverUnacknowledgedMessages
    partitionMetadata: CommandPartitionedTopicMetadata
    partitionMetadataResponse: CommandPartitionedTopicMetadataResponse
    lookupTopic: CommandLookupTopic
    lookupTopicResponse: CommandLookupTopicResponse
    consumerStats: CommandConsumerStats
    consumerStatsResponse: CommandConsumerStatsResponse
    reachedEndOfTopic: CommandReachedEndOfTopic
    seek: CommandSeek
    getLastMessageId: CommandGetLastMessageId
    getLastMessageIdResponse: CommandGetLastMessageIdResponse
    active_consumer_change: CommandActiveConsumerChange
    getTopicsOfNamespace: CommandGetTopicsOfNamespace
    getTopicsOfNamespaceResponse: CommandGetTopicsOfNamespaceResponse
    getSchema: CommandGetSchema
    getSchemaResponse: CommandGetSchemaResponse
    authChallenge: CommandAuthChallenge
    authResponse: CommandAuthResponse
    ackResponse: CommandAckResponse
    getOrCreateSchema: CommandGetOrCreateSchema
    getOrCreateSchemaResponse: CommandGetOrCreateSchemaResponse
    newTxn: CommandNewTxn
    newTxnResponse: CommandNewTxnResponse
    addPartitionToTxn: CommandAddPartitionToTxn
    addPartitionToTxnResponse: CommandAddPartitionToTxnResponse
    addSubscriptionToTxn: CommandAddSubscriptionToTxn
    addSubscriptionToTxnResponse: CommandAddSubscriptionToTxnResponse
    endTxn: CommandEndTxn
    endTxnResponse: CommandEndTxnResponse
    endTxnOnPartition: CommandEndTxnOnPartition
    endTxnOnPartitionResponse: CommandEndTxnOnPartitionResponse
    endTxnOnSubscription: CommandEndTxnOnSubscription
    endTxnOnSubscriptionResponse: CommandEndTxnOnSubscriptionResponse
    tcClientConnectRequest: CommandTcClientConnectRequest
    tcClientConnectResponse: CommandTcClientConnectResponse
    watchTopicList: CommandWatchTopicList
    watchTopicListSuccess: CommandWatchTopicListSuccess
    watchTopicUpdate: CommandWatchTopicUpdate
    watchTopicListClose: CommandWatchTopicListClose
    topicMigrated: CommandTopicMigrated
    scalableTopicLookup: CommandScalableTopicLookup
    scalableTopicUpdate: CommandScalableTopicUpdate
    scalableTopicClose: CommandScalableTopicClose
    scalableTopicSubscribe: CommandScalableTopicSubscribe
    scalableTopicSubscribeResponse: CommandScalableTopicSubscribeResponse
    scalableTopicAssignmentUpdate: CommandScalableTopicAssignmentUpdate
    watchScalableTopics: CommandWatchScalableTopics
    watchScalableTopicsUpdate: CommandWatchScalableTopicsUpdate
    watchScalableTopicsClose: CommandWatchScalableTopicsClose
    watchTcAssignments: CommandWatchTcAssignments
    watchTcAssignmentsUpdate: CommandWatchTcAssignmentsUpdate
    watchTcAssignmentsClose: CommandWatchTcAssignmentsClose
    def __init__(self, type: _Optional[_Union[BaseCommand.Type, str]] = ..., connect: _Optional[_Union[CommandConnect, _Mapping]] = ..., connected: _Optional[_Union[CommandConnected, _Mapping]] = ..., subscribe: _Optional[_Union[CommandSubscribe, _Mapping]] = ..., producer: _Optional[_Union[CommandProducer, _Mapping]] = ..., send: _Optional[_Union[CommandSend, _Mapping]] = ..., send_receipt: _Optional[_Union[CommandSendReceipt, _Mapping]] = ..., send_error: _Optional[_Union[CommandSendError, _Mapping]] = ..., message: _Optional[_Union[CommandMessage, _Mapping]] = ..., ack: _Optional[_Union[CommandAck, _Mapping]] = ..., flow: _Optional[_Union[CommandFlow, _Mapping]] = ..., unsubscribe: _Optional[_Union[CommandUnsubscribe, _Mapping]] = ..., success: _Optional[_Union[CommandSuccess, _Mapping]] = ..., error: _Optional[_Union[CommandError, _Mapping]] = ..., close_producer: _Optional[_Union[CommandCloseProducer, _Mapping]] = ..., close_consumer: _Optional[_Union[CommandCloseConsumer, _Mapping]] = ..., producer_success: _Optional[_Union[CommandProducerSuccess, _Mapping]] = ..., ping: _Optional[_Union[CommandPing, _Mapping]] = ..., pong: _Optional[_Union[CommandPong, _Mapping]] = ..., redeliverUnacknowledgedMessages: _Optional[_Union[CommandRedeliverUnacknowledgedMessages, _Mapping]] = ..., partitionMetadata: _Optional[_Union[CommandPartitionedTopicMetadata, _Mapping]] = ..., partitionMetadataResponse: _Optional[_Union[CommandPartitionedTopicMetadataResponse, _Mapping]] = ..., lookupTopic: _Optional[_Union[CommandLookupTopic, _Mapping]] = ..., lookupTopicResponse: _Optional[_Union[CommandLookupTopicResponse, _Mapping]] = ..., consumerStats: _Optional[_Union[CommandConsumerStats, _Mapping]] = ..., consumerStatsResponse: _Optional[_Union[CommandConsumerStatsResponse, _Mapping]] = ..., reachedEndOfTopic: _Optional[_Union[CommandReachedEndOfTopic, _Mapping]] = ..., seek: _Optional[_Union[CommandSeek, _Mapping]] = ..., getLastMessageId: _Optional[_Union[CommandGetLastMessageId, _Mapping]] = ..., getLastMessageIdResponse: _Optional[_Union[CommandGetLastMessageIdResponse, _Mapping]] = ..., active_consumer_change: _Optional[_Union[CommandActiveConsumerChange, _Mapping]] = ..., getTopicsOfNamespace: _Optional[_Union[CommandGetTopicsOfNamespace, _Mapping]] = ..., getTopicsOfNamespaceResponse: _Optional[_Union[CommandGetTopicsOfNamespaceResponse, _Mapping]] = ..., getSchema: _Optional[_Union[CommandGetSchema, _Mapping]] = ..., getSchemaResponse: _Optional[_Union[CommandGetSchemaResponse, _Mapping]] = ..., authChallenge: _Optional[_Union[CommandAuthChallenge, _Mapping]] = ..., authResponse: _Optional[_Union[CommandAuthResponse, _Mapping]] = ..., ackResponse: _Optional[_Union[CommandAckResponse, _Mapping]] = ..., getOrCreateSchema: _Optional[_Union[CommandGetOrCreateSchema, _Mapping]] = ..., getOrCreateSchemaResponse: _Optional[_Union[CommandGetOrCreateSchemaResponse, _Mapping]] = ..., newTxn: _Optional[_Union[CommandNewTxn, _Mapping]] = ..., newTxnResponse: _Optional[_Union[CommandNewTxnResponse, _Mapping]] = ..., addPartitionToTxn: _Optional[_Union[CommandAddPartitionToTxn, _Mapping]] = ..., addPartitionToTxnResponse: _Optional[_Union[CommandAddPartitionToTxnResponse, _Mapping]] = ..., addSubscriptionToTxn: _Optional[_Union[CommandAddSubscriptionToTxn, _Mapping]] = ..., addSubscriptionToTxnResponse: _Optional[_Union[CommandAddSubscriptionToTxnResponse, _Mapping]] = ..., endTxn: _Optional[_Union[CommandEndTxn, _Mapping]] = ..., endTxnResponse: _Optional[_Union[CommandEndTxnResponse, _Mapping]] = ..., endTxnOnPartition: _Optional[_Union[CommandEndTxnOnPartition, _Mapping]] = ..., endTxnOnPartitionResponse: _Optional[_Union[CommandEndTxnOnPartitionResponse, _Mapping]] = ..., endTxnOnSubscription: _Optional[_Union[CommandEndTxnOnSubscription, _Mapping]] = ..., endTxnOnSubscriptionResponse: _Optional[_Union[CommandEndTxnOnSubscriptionResponse, _Mapping]] = ..., tcClientConnectRequest: _Optional[_Union[CommandTcClientConnectRequest, _Mapping]] = ..., tcClientConnectResponse: _Optional[_Union[CommandTcClientConnectResponse, _Mapping]] = ..., watchTopicList: _Optional[_Union[CommandWatchTopicList, _Mapping]] = ..., watchTopicListSuccess: _Optional[_Union[CommandWatchTopicListSuccess, _Mapping]] = ..., watchTopicUpdate: _Optional[_Union[CommandWatchTopicUpdate, _Mapping]] = ..., watchTopicListClose: _Optional[_Union[CommandWatchTopicListClose, _Mapping]] = ..., topicMigrated: _Optional[_Union[CommandTopicMigrated, _Mapping]] = ..., scalableTopicLookup: _Optional[_Union[CommandScalableTopicLookup, _Mapping]] = ..., scalableTopicUpdate: _Optional[_Union[CommandScalableTopicUpdate, _Mapping]] = ..., scalableTopicClose: _Optional[_Union[CommandScalableTopicClose, _Mapping]] = ..., scalableTopicSubscribe: _Optional[_Union[CommandScalableTopicSubscribe, _Mapping]] = ..., scalableTopicSubscribeResponse: _Optional[_Union[CommandScalableTopicSubscribeResponse, _Mapping]] = ..., scalableTopicAssignmentUpdate: _Optional[_Union[CommandScalableTopicAssignmentUpdate, _Mapping]] = ..., watchScalableTopics: _Optional[_Union[CommandWatchScalableTopics, _Mapping]] = ..., watchScalableTopicsUpdate: _Optional[_Union[CommandWatchScalableTopicsUpdate, _Mapping]] = ..., watchScalableTopicsClose: _Optional[_Union[CommandWatchScalableTopicsClose, _Mapping]] = ..., watchTcAssignments: _Optional[_Union[CommandWatchTcAssignments, _Mapping]] = ..., watchTcAssignmentsUpdate: _Optional[_Union[CommandWatchTcAssignmentsUpdate, _Mapping]] = ..., watchTcAssignmentsClose: _Optional[_Union[CommandWatchTcAssignmentsClose, _Mapping]] = ...) -> None: ...
