"""A unit's lifecycle: where its compute copy is, where it is in the step, where its gradients are; changed in one
place, by named events.

Why a table: the engine, the gradient shipper, the optimizer and the hooks all move a unit along, from three
threads (the one running forward/backward, the gradient worker, the step thread). When each of them set flags of
its own, "is blocks.3 done with backward?" had no single answer and no wrong order could be caught. Here every
change is `lifecycle.on(Event.X)`, checked against the transitions below (as FSDP2 checks its `TrainingState`), and
the unit's state is three enums to read.

    params:  RELEASED --fetch--> FETCHING --fetched--> READY --evict--> RELEASED
             READY --keep for step--> KEPT_FOR_STEP --fetched / evict--> READY / RELEASED
             RESIDENT (params on the device tier) never moves
    phase:   IDLE --forward start--> FORWARD --forward end--> AWAITING_BACKWARD (under grad) or IDLE
             AWAITING_BACKWARD --backward start--> BACKWARD --backward end--> IDLE
    grads:   EMPTY|STORED|HELD --shipped--> SHIPPING --landed--> STORED or HELD (kept for the step)
             EMPTY|STORED --stored--> STORED (added in place: addressable where they were computed)
             EMPTY|STORED|HELD --stepped / zero grad--> EMPTY

KEPT_FOR_STEP: the root of a CPU run whose step runs in place on its materialised params ([Note: master from the
fetch], unit.py); they stay for the next forward. Micro-batches may overlap in SHIPPING (the gradients of one
backward still travelling while the next backward ships): `SHIPPING` counts them, the last one to land decides.
"""

from __future__ import annotations

import threading
from enum import Enum


class ParamsState(str, Enum):
    """The compute copy of a unit's parameters."""

    RESIDENT = "resident"
    RELEASED = "released"
    FETCHING = "fetching"
    READY = "ready"
    KEPT_FOR_STEP = "kept for step"


class Phase(str, Enum):
    """Where the unit is in forward and backward."""

    IDLE = "idle"
    FORWARD = "forward"
    AWAITING_BACKWARD = "awaiting backward"
    BACKWARD = "backward"


class GradsState(str, Enum):
    """The unit's accumulated gradients between two optimizer steps."""

    EMPTY = "empty"
    SHIPPING = "shipping"
    STORED = "stored"
    HELD = "held"


class Event(str, Enum):
    FETCH = "fetch"
    FETCHED = "fetched"
    KEEP_FOR_STEP = "keep for step"
    EVICT = "evict"
    FORWARD_START = "forward start"
    FORWARD_END = "forward end"
    FORWARD_END_NO_GRAD = "forward end without grad"
    BACKWARD_START = "backward start"
    BACKWARD_END = "backward end"
    GRADS_SHIPPED = "grads shipped"
    GRADS_STORED = "grads stored"
    GRADS_LANDED = "grads landed"
    GRADS_HELD = "grads held"
    STEPPED = "stepped"
    ZERO_GRAD = "zero grad"


P, H, G = ParamsState, Phase, GradsState

# event -> (field, {old state: new state}). Everything else is a wrong order: an assertion.
_TRANSITIONS: dict[Event, tuple[str, dict]] = {
    Event.FETCH: ("params", {P.RELEASED: P.FETCHING}),
    Event.FETCHED: ("params", {P.FETCHING: P.READY, P.KEPT_FOR_STEP: P.READY}),
    Event.KEEP_FOR_STEP: ("params", {P.READY: P.KEPT_FOR_STEP}),
    Event.EVICT: ("params", {P.FETCHING: P.RELEASED, P.READY: P.RELEASED, P.KEPT_FOR_STEP: P.RELEASED}),
    # A unit may be called again before its backward (weight sharing), or under no_grad while awaiting it.
    Event.FORWARD_START: ("phase", {H.IDLE: H.FORWARD, H.AWAITING_BACKWARD: H.FORWARD, H.FORWARD: H.FORWARD,
                                    H.BACKWARD: H.FORWARD}),
    Event.FORWARD_END: ("phase", {H.FORWARD: H.AWAITING_BACKWARD, H.AWAITING_BACKWARD: H.AWAITING_BACKWARD}),
    # A call under no_grad: a unit awaiting its backward (called again, e.g. for evaluation) still awaits it.
    Event.FORWARD_END_NO_GRAD: ("phase", {H.FORWARD: H.IDLE, H.IDLE: H.IDLE,
                                          H.AWAITING_BACKWARD: H.AWAITING_BACKWARD, H.BACKWARD: H.BACKWARD}),
    Event.BACKWARD_START: ("phase", {H.AWAITING_BACKWARD: H.BACKWARD, H.BACKWARD: H.BACKWARD,
                                     H.FORWARD: H.BACKWARD}),
    Event.BACKWARD_END: ("phase", {H.AWAITING_BACKWARD: H.IDLE, H.BACKWARD: H.IDLE, H.FORWARD: H.IDLE,
                                   H.IDLE: H.IDLE}),
    Event.GRADS_SHIPPED: ("grads", {G.EMPTY: G.SHIPPING, G.STORED: G.SHIPPING, G.HELD: G.SHIPPING,
                                    G.SHIPPING: G.SHIPPING}),
    Event.GRADS_STORED: ("grads", {G.EMPTY: G.STORED, G.STORED: G.STORED}),
    Event.GRADS_LANDED: ("grads", {G.SHIPPING: G.STORED}),
    Event.GRADS_HELD: ("grads", {G.SHIPPING: G.HELD}),
    Event.STEPPED: ("grads", {G.EMPTY: G.EMPTY, G.STORED: G.EMPTY, G.HELD: G.EMPTY}),
    Event.ZERO_GRAD: ("grads", {G.EMPTY: G.EMPTY, G.STORED: G.EMPTY, G.HELD: G.EMPTY}),
}


class Lifecycle:
    """The three states of one unit and the one method that changes them (any thread)."""

    def __init__(self, name: str, resident: bool) -> None:
        self.name = name
        self.params = ParamsState.RESIDENT if resident else ParamsState.RELEASED
        self.phase = Phase.IDLE
        self.grads = GradsState.EMPTY
        self._shipping = 0  # ships of this unit's gradients in flight (micro-batches may overlap)
        self._lock = threading.Lock()

    def on(self, event: Event) -> None:
        """Apply `event`; an event the current state does not allow is an AssertionError naming both."""
        field, moves = _TRANSITIONS[event]
        with self._lock:
            old = getattr(self, field)
            if field == "params" and old == ParamsState.RESIDENT:
                return  # resident params never move
            assert old in moves, f"{self.name}: {event.value} in {field} state {old.value}"
            if field == "grads":
                if event is Event.GRADS_SHIPPED:
                    self._shipping += 1
                elif old == GradsState.SHIPPING:
                    self._shipping -= 1
                    if self._shipping:
                        return  # another micro-batch's gradients are still on their way
            setattr(self, field, moves[old])

    @property
    def on_device(self) -> bool:
        return self.params != ParamsState.RELEASED

    def __repr__(self) -> str:
        return (f"Lifecycle({self.name}: params {self.params.value}, {self.phase.value}, "
                f"grads {self.grads.value})")
