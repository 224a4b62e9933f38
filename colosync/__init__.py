"""colosync: move a trainer's weights into a colocated inference engine as a transaction.

Trainer side: ``Sender`` (``push``, ``push_peft``, ``push_stream``, ``drop_adapter``) over a
``Link`` to the engine, or an ``EngineSet`` of links to update several engines as one
transaction (separated mode), each push verifiable with a ``Probe`` (``Probe.from_model``). Engine
side: ``Receiver`` driving an ``EngineTarget``. Bytes move through a transport
(``colosync.transports``); control messages are typed structs (``colosync.wire.protocol``).
Engines, Ray, Megatron and PEFT are imported only where they are used.
"""

from colosync.control.engine_set import EngineSet
from colosync.control.link import LocalLink
from colosync.errors import (
    AdapterSlotsError,
    ColosyncError,
    ConfigError,
    DeliveryError,
    DtypeError,
    EngineBusyError,
    EngineError,
    EngineSetError,
    FailedClosedError,
    FingerprintMismatchError,
    GroupJoinError,
    IncompleteUpdateError,
    ManifestError,
    NonFiniteError,
    RankError,
    ShapeMismatchError,
    StaleUpdateError,
    TiedWeightError,
    TransactionStateError,
    TransportError,
    TransportUnavailable,
    UnknownTensorError,
    UpdateRejected,
    UpdateTimeoutError,
)
from colosync.sync.link import EngineOutcome, Link
from colosync.sync.receiver import Receiver
from colosync.sync.sender import Sender, SyncReport, peft_lora_spec, peft_lora_tensors
from colosync.sync.target import EngineTarget, ModelSpec, ParamSpec, ReceiverPolicy
from colosync.wire.bucket import TensorSpec
from colosync.wire.manifest import AdapterPolicy, Layout, LoraSpec, TensorMeta, UpdateManifest
from colosync.wire.protocol import Probe
from colosync.workloads import WORKLOADS_DIR

__version__ = "0.4.0"


__all__ = [
    "WORKLOADS_DIR",
    "AdapterPolicy",
    "AdapterSlotsError",
    "ColosyncError",
    "ConfigError",
    "DeliveryError",
    "DtypeError",
    "EngineBusyError",
    "EngineError",
    "EngineOutcome",
    "EngineSet",
    "EngineSetError",
    "FailedClosedError",
    "FingerprintMismatchError",
    "GroupJoinError",
    "IncompleteUpdateError",
    "ManifestError",
    "NonFiniteError",
    "Probe",
    "RankError",
    "ShapeMismatchError",
    "StaleUpdateError",
    "TiedWeightError",
    "TransactionStateError",
    "TransportError",
    "TransportUnavailable",
    "UnknownTensorError",
    "UpdateRejected",
    "UpdateTimeoutError",
    "Layout",
    "Link",
    "LocalLink",
    "LoraSpec",
    "TensorMeta",
    "TensorSpec",
    "UpdateManifest",
    "Receiver",
    "ReceiverPolicy",
    "Sender",
    "SyncReport",
    "peft_lora_spec",
    "peft_lora_tensors",
    "EngineTarget",
    "ModelSpec",
    "ParamSpec",
]
