from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    STAGE: _ClassVar[Role]
    FRONTEND: _ClassVar[Role]

class ReplicaState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[ReplicaState]
    REGISTERING: _ClassVar[ReplicaState]
    READY: _ClassVar[ReplicaState]
    DRAINING: _ClassVar[ReplicaState]
    SUSPECT: _ClassVar[ReplicaState]
    DEAD: _ClassVar[ReplicaState]

class CommandKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMMAND_UNSPECIFIED: _ClassVar[CommandKind]
    DRAIN: _ClassVar[CommandKind]
    SLEEP: _ClassVar[CommandKind]
    WAKE_UP: _ClassVar[CommandKind]
    SHUTDOWN: _ClassVar[CommandKind]
    UNDRAIN: _ClassVar[CommandKind]
    QUIESCE: _ClassVar[CommandKind]
ROLE_UNSPECIFIED: Role
STAGE: Role
FRONTEND: Role
STATE_UNSPECIFIED: ReplicaState
REGISTERING: ReplicaState
READY: ReplicaState
DRAINING: ReplicaState
SUSPECT: ReplicaState
DEAD: ReplicaState
COMMAND_UNSPECIFIED: CommandKind
DRAIN: CommandKind
SLEEP: CommandKind
WAKE_UP: CommandKind
SHUTDOWN: CommandKind
UNDRAIN: CommandKind
QUIESCE: CommandKind

class RegisterRequest(_message.Message):
    __slots__ = ("role", "stage_id", "replica_hint", "host", "pid", "endpoints", "config_hash", "pipeline_config_json", "version", "capabilities", "instance_id")
    class EndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_HINT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    role: Role
    stage_id: int
    replica_hint: int
    host: str
    pid: int
    endpoints: _containers.ScalarMap[str, str]
    config_hash: str
    pipeline_config_json: str
    version: str
    capabilities: _containers.ScalarMap[str, str]
    instance_id: str
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., stage_id: _Optional[int] = ..., replica_hint: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., endpoints: _Optional[_Mapping[str, str]] = ..., config_hash: _Optional[str] = ..., pipeline_config_json: _Optional[str] = ..., version: _Optional[str] = ..., capabilities: _Optional[_Mapping[str, str]] = ..., instance_id: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("replica_id", "replica_index", "lease_id", "lease_ttl_s", "stage_config_json", "pipeline_config_json")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    STAGE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    replica_index: int
    lease_id: str
    lease_ttl_s: float
    stage_config_json: str
    pipeline_config_json: str
    def __init__(self, replica_id: _Optional[str] = ..., replica_index: _Optional[int] = ..., lease_id: _Optional[str] = ..., lease_ttl_s: _Optional[float] = ..., stage_config_json: _Optional[str] = ..., pipeline_config_json: _Optional[str] = ...) -> None: ...

class CommandAck(_message.Message):
    __slots__ = ("command_id", "ok", "message")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    ok: bool
    message: str
    def __init__(self, command_id: _Optional[str] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("lease_id", "replica_id", "queue_len", "in_flight", "requests_total", "cpu_seconds", "is_sleeping", "draining", "extra", "acks", "no_load")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    ACKS_FIELD_NUMBER: _ClassVar[int]
    NO_LOAD_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    replica_id: str
    queue_len: int
    in_flight: int
    requests_total: int
    cpu_seconds: float
    is_sleeping: bool
    draining: bool
    extra: _containers.ScalarMap[str, float]
    acks: _containers.RepeatedCompositeFieldContainer[CommandAck]
    no_load: bool
    def __init__(self, lease_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., queue_len: _Optional[int] = ..., in_flight: _Optional[int] = ..., requests_total: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., is_sleeping: _Optional[bool] = ..., draining: _Optional[bool] = ..., extra: _Optional[_Mapping[str, float]] = ..., acks: _Optional[_Iterable[_Union[CommandAck, _Mapping]]] = ..., no_load: _Optional[bool] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("command_id", "kind", "args_json")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    kind: CommandKind
    args_json: str
    def __init__(self, command_id: _Optional[str] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., args_json: _Optional[str] = ...) -> None: ...

class DeregisterRequest(_message.Message):
    __slots__ = ("lease_id",)
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    def __init__(self, lease_id: _Optional[str] = ...) -> None: ...

class DeregisterResponse(_message.Message):
    __slots__ = ("removed",)
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    def __init__(self, removed: _Optional[bool] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("stage_id", "replica_id", "replica_index", "role", "host", "pid", "endpoints", "state", "queue_len", "in_flight", "requests_total", "cpu_seconds", "is_sleeping", "draining", "extra", "heartbeat_age_s", "version", "capabilities")
    class EndpointsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class CapabilitiesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_LEN_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IS_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    replica_id: str
    replica_index: int
    role: Role
    host: str
    pid: int
    endpoints: _containers.ScalarMap[str, str]
    state: ReplicaState
    queue_len: int
    in_flight: int
    requests_total: int
    cpu_seconds: float
    is_sleeping: bool
    draining: bool
    extra: _containers.ScalarMap[str, float]
    heartbeat_age_s: float
    version: str
    capabilities: _containers.ScalarMap[str, str]
    def __init__(self, stage_id: _Optional[int] = ..., replica_id: _Optional[str] = ..., replica_index: _Optional[int] = ..., role: _Optional[_Union[Role, str]] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ..., endpoints: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[ReplicaState, str]] = ..., queue_len: _Optional[int] = ..., in_flight: _Optional[int] = ..., requests_total: _Optional[int] = ..., cpu_seconds: _Optional[float] = ..., is_sleeping: _Optional[bool] = ..., draining: _Optional[bool] = ..., extra: _Optional[_Mapping[str, float]] = ..., heartbeat_age_s: _Optional[float] = ..., version: _Optional[str] = ..., capabilities: _Optional[_Mapping[str, str]] = ...) -> None: ...

class StageStatus(_message.Message):
    __slots__ = ("stage_id", "ready_replicas", "live_replicas")
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    READY_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LIVE_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    stage_id: int
    ready_replicas: int
    live_replicas: int
    def __init__(self, stage_id: _Optional[int] = ..., ready_replicas: _Optional[int] = ..., live_replicas: _Optional[int] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("replicas", "stages", "config_hash", "has_config", "lease_ttl_s", "pipeline_config_json")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    STAGES_FIELD_NUMBER: _ClassVar[int]
    CONFIG_HASH_FIELD_NUMBER: _ClassVar[int]
    HAS_CONFIG_FIELD_NUMBER: _ClassVar[int]
    LEASE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    stages: _containers.RepeatedCompositeFieldContainer[StageStatus]
    config_hash: str
    has_config: bool
    lease_ttl_s: float
    pipeline_config_json: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., stages: _Optional[_Iterable[_Union[StageStatus, _Mapping]]] = ..., config_hash: _Optional[str] = ..., has_config: _Optional[bool] = ..., lease_ttl_s: _Optional[float] = ..., pipeline_config_json: _Optional[str] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopologyEvent(_message.Message):
    __slots__ = ("kind", "replicas", "seq")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[TopologyEvent.Kind]
        SNAPSHOT: _ClassVar[TopologyEvent.Kind]
        ADDED: _ClassVar[TopologyEvent.Kind]
        UPDATED: _ClassVar[TopologyEvent.Kind]
        REMOVED: _ClassVar[TopologyEvent.Kind]
    KIND_UNSPECIFIED: TopologyEvent.Kind
    SNAPSHOT: TopologyEvent.Kind
    ADDED: TopologyEvent.Kind
    UPDATED: TopologyEvent.Kind
    REMOVED: TopologyEvent.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    kind: TopologyEvent.Kind
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaInfo]
    seq: int
    def __init__(self, kind: _Optional[_Union[TopologyEvent.Kind, str]] = ..., replicas: _Optional[_Iterable[_Union[ReplicaInfo, _Mapping]]] = ..., seq: _Optional[int] = ...) -> None: ...

class SendCommandRequest(_message.Message):
    __slots__ = ("stage_ids", "kind", "args_json", "timeout_s", "replica_ids", "keep_serving")
    STAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARGS_JSON_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    KEEP_SERVING_FIELD_NUMBER: _ClassVar[int]
    stage_ids: _containers.RepeatedScalarFieldContainer[int]
    kind: CommandKind
    args_json: str
    timeout_s: float
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    keep_serving: bool
    def __init__(self, stage_ids: _Optional[_Iterable[int]] = ..., kind: _Optional[_Union[CommandKind, str]] = ..., args_json: _Optional[str] = ..., timeout_s: _Optional[float] = ..., replica_ids: _Optional[_Iterable[str]] = ..., keep_serving: _Optional[bool] = ...) -> None: ...

class CommandResult(_message.Message):
    __slots__ = ("replica_id", "stage_id", "ok", "message", "outcome")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    STAGE_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    stage_id: int
    ok: bool
    message: str
    outcome: str
    def __init__(self, replica_id: _Optional[str] = ..., stage_id: _Optional[int] = ..., ok: _Optional[bool] = ..., message: _Optional[str] = ..., outcome: _Optional[str] = ...) -> None: ...

class SendCommandResponse(_message.Message):
    __slots__ = ("command_id", "results")
    COMMAND_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    command_id: str
    results: _containers.RepeatedCompositeFieldContainer[CommandResult]
    def __init__(self, command_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[CommandResult, _Mapping]]] = ...) -> None: ...

class KvPutRequest(_message.Message):
    __slots__ = ("namespace", "key", "value", "only_if_exists", "only_if_absent")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ONLY_IF_EXISTS_FIELD_NUMBER: _ClassVar[int]
    ONLY_IF_ABSENT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    value: bytes
    only_if_exists: bool
    only_if_absent: bool
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., only_if_exists: _Optional[bool] = ..., only_if_absent: _Optional[bool] = ...) -> None: ...

class KvPutResponse(_message.Message):
    __slots__ = ("absent",)
    ABSENT_FIELD_NUMBER: _ClassVar[int]
    absent: bool
    def __init__(self, absent: _Optional[bool] = ...) -> None: ...

class KvGetRequest(_message.Message):
    __slots__ = ("namespace", "key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class KvGetResponse(_message.Message):
    __slots__ = ("found", "value")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvListRequest(_message.Message):
    __slots__ = ("namespace", "prefix", "limit", "start_after")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    START_AFTER_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    prefix: str
    limit: int
    start_after: str
    def __init__(self, namespace: _Optional[str] = ..., prefix: _Optional[str] = ..., limit: _Optional[int] = ..., start_after: _Optional[str] = ...) -> None: ...

class KvEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class KvListResponse(_message.Message):
    __slots__ = ("entries", "next_start_after")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    NEXT_START_AFTER_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[KvEntry]
    next_start_after: str
    def __init__(self, entries: _Optional[_Iterable[_Union[KvEntry, _Mapping]]] = ..., next_start_after: _Optional[str] = ...) -> None: ...

class KvDeleteRequest(_message.Message):
    __slots__ = ("namespace", "key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    key: str
    def __init__(self, namespace: _Optional[str] = ..., key: _Optional[str] = ...) -> None: ...

class KvDeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: bool
    def __init__(self, deleted: _Optional[bool] = ...) -> None: ...
