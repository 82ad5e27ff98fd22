"""Flow control: priorities, fairness between tenants, saturation and shedding.

Applied before scheduling: :meth:`FlowController.admit` lets a request through, queues it, or
sheds it; the gateway releases the returned :class:`Ticket` when the request is finished.
"""

from flow_control.config import (
    BandConfig,
    FlowControlConfig,
    ObjectiveConfig,
    PriorityBandConfig,
    ProgramAwareConfig,
    SaturationDetectorConfig,
    SessionBoostConfig,
)
from flow_control.controller import FlowController
from flow_control.policies import (
    FCFSPolicy,
    ProgramAwarePolicy,
    RoundRobinPolicy,
    make_policy,
)
from flow_control.queues import FairnessPolicy
from flow_control.request import DEFAULT_FLOW, FlowRequest, Ticket
from flow_control.resolve import (
    FAIRNESS_HEADERS,
    OBJECTIVE_HEADERS,
    Objective,
    ObjectiveResolver,
    SessionBoost,
    SessionMemory,
    fairness_id,
)
from flow_control.saturation import (
    SaturationDetector,
    ThresholdSaturationDetector,
    default_staleness,
)

__all__ = [
    "DEFAULT_FLOW",
    "FAIRNESS_HEADERS",
    "OBJECTIVE_HEADERS",
    "BandConfig",
    "FCFSPolicy",
    "FairnessPolicy",
    "FlowControlConfig",
    "FlowController",
    "FlowRequest",
    "Objective",
    "ObjectiveConfig",
    "ObjectiveResolver",
    "PriorityBandConfig",
    "ProgramAwareConfig",
    "ProgramAwarePolicy",
    "RoundRobinPolicy",
    "SaturationDetector",
    "SaturationDetectorConfig",
    "SessionBoost",
    "SessionBoostConfig",
    "SessionMemory",
    "ThresholdSaturationDetector",
    "Ticket",
    "default_staleness",
    "fairness_id",
    "make_policy",
]
