"""Averaging: how a group of peers agrees on the mean of their tensors.

Modules, pure code first:

- ``_group``: a group's ordered members, their modes (node, client, aux) and id
- ``_partition``: flatten tensors and cut the vector into parts by link rate
- ``_link_meter``: a peer's upload and download rates, measured from its rounds
- ``_codecs``: parts on the wire: float32, float16, 8-bit blockwise, 4-bit groups
- ``_reducer``: per-chunk weighted accumulation that survives failed senders
- ``_robust``: CenteredClip, Byzantine-robust aggregation of a chunk
- ``_faults``: fault plans, injected by composition into the real code
- ``_moshpit``: the Moshpit grid, its key schedule and group placement
- ``_grid``: ``GridAgreement``, one grid per epoch that every peer computes alike,
  proposed and read ahead of the rounds (``GridSchedule``)
- ``_rounds``: the rounds a peer runs now, by group id, where a stream finds its round
- ``_allreduce``: the fault-tolerant butterfly all-reduce over peer connections
- ``_ring``: the pipelined ring all-reduce, one flow per link, for groups whose
  links are alike (``AllReduceConfig(ring=True)``; a broken ring falls back)
- ``_datagrams``: the lossy data plane's authenticated, frame-sized datagrams
- ``_pieces``: which pieces arrived, and the per-piece renormalised mean over them
- ``_pacing``: the lossy data plane's send rate and schedule, from receiver reports
- ``_lossy``: the lossy all-reduce round (``AllReduceConfig(lossy=True)``)
- ``_matchmaking``: leader-based group formation over the DHT
- ``_averager``: ``Averager``, one Moshpit round per ``step()``
- ``_scheduled``: ``ScheduledRound``, a round found ahead, then triggered
  (a weight, or 0 to join without data) or cancelled (group-mates told at once)
- ``_arctopk``: ARC-Top-K, Top-K compression a group all-reduces without indices
- ``_state_transfer``: newcomers download the current state from donors
- ``_staging``: reused (pinned) host buffers between a device and the wire,
  whole (``HostStaging``) or a chunk at a time (``ChunkedStaging``)
"""

from ._allreduce import (
    AllReduceConfig,
    AllReduceResult,
    all_reduce,
    listen_to_sender_weights,
    sender_weights,
    serve_allreduce,
)
from ._arctopk import ArcTopKRound, RowSelection, arc_topk_compress, contraction_bound, select_rows
from ._averager import (
    Averager,
    AveragerConfig,
    StepInProgressError,
    StepResult,
    chunked_contributors,
)
from ._codecs import FLOAT16, NONE, UINT4, UINT8, Codec, CodecKind
from ._faults import DatagramFaults, FaultPlan, InjectedFault, MemberFault
from ._grid import GridAgreement, GridProposal, GridSchedule
from ._group import Group, GroupMember, MemberMode
from ._link_meter import LinkMeter
from ._matchmaking import Expected, MatchmakingConfig
from ._moshpit import MoshpitGrid, MoshpitState
from ._partition import flat_zeros_like
from ._robust import CenteredClip
from ._scheduled import RoundClosedError, ScheduledRound
from ._staging import ChunkedStaging, HostStaging, LocalTensorError, float32_accumulators
from ._state_transfer import (
    UNCHECKED,
    LoadedState,
    StateTransferConfig,
    load_state_from_peers,
    serve_state,
)

__all__ = [
    "FLOAT16",
    "NONE",
    "UINT4",
    "UINT8",
    "UNCHECKED",
    "AllReduceConfig",
    "AllReduceResult",
    "ArcTopKRound",
    "Averager",
    "AveragerConfig",
    "CenteredClip",
    "ChunkedStaging",
    "Codec",
    "CodecKind",
    "DatagramFaults",
    "Expected",
    "FaultPlan",
    "GridAgreement",
    "GridProposal",
    "GridSchedule",
    "Group",
    "GroupMember",
    "HostStaging",
    "InjectedFault",
    "LinkMeter",
    "LoadedState",
    "LocalTensorError",
    "MatchmakingConfig",
    "MemberFault",
    "MemberMode",
    "MoshpitGrid",
    "MoshpitState",
    "RoundClosedError",
    "RowSelection",
    "ScheduledRound",
    "StateTransferConfig",
    "StepInProgressError",
    "StepResult",
    "all_reduce",
    "arc_topk_compress",
    "chunked_contributors",
    "contraction_bound",
    "flat_zeros_like",
    "float32_accumulators",
    "listen_to_sender_weights",
    "load_state_from_peers",
    "select_rows",
    "sender_weights",
    "serve_allreduce",
    "serve_state",
]
