"""A recording fake of the streams and events of ``cupy.cuda`` that ``numbasplat.device.PartStreams``
uses, for tests of the aggregate device's fork and join (tests/test_aggregate.py) without a GPU.

``RecordingCuda`` stands in for ``cupy.cuda`` (``PartStreams(parts, api=RecordingCuda())``) and
notes, in the host's order, each event recorded on a stream, each wait of a stream for an event,
and each kernel launch (``recording`` wraps a launch function: the launch goes on the current
stream).  ``unordered()`` replays the notes as the GPU would order them (a launch comes after the
launches queued before it on its stream, and after those before an event its stream waited for)
and lists the pairs of launches that may overlap where they must not: any but two launches of one
operator on different parts' streams (the window between a fork, an event recorded on the
caller's stream, and the next)."""
from contextlib import nullcontext
from dataclasses import dataclass, field


@dataclass(eq=False)
class FakeEvent:
    after: frozenset = frozenset()  # the launches the GPU runs before the event (of its last record)


@dataclass(eq=False)
class FakeStream:
    cuda: "RecordingCuda"
    name: str
    after: set = field(default_factory=set)  # the launches a launch queued here next comes after

    def record(self, event=None):
        event = event or FakeEvent()
        event.after = frozenset(self.after)
        self.cuda.log.append(("record", self, event))
        if self is self.cuda.caller:
            self.cuda.forks += 1
        return event

    def wait_event(self, event):
        self.after |= event.after
        self.cuda.log.append(("wait", self, event))

    def __enter__(self):
        self._previous, self.cuda.current = self.cuda.current, self
        return self

    def __exit__(self, *exc):
        self.cuda.current = self._previous


@dataclass
class Launch:
    index: int         # in the host's order
    name: str
    stream: FakeStream
    window: int        # the forks before it (the operator it belongs to, on a part's stream)
    after: frozenset   # the launches the GPU runs before it


class RecordingCuda:
    """The fake ``cupy.cuda`` (see the module's docstring): ``get_current_stream``, ``Stream``, ``Event``,
    ``Device``.  The caller's stream is ``caller``; every stream made later is a part's."""

    def __init__(self):
        self.caller = FakeStream(self, "caller")
        self.current = self.caller
        self.parts = []
        self.log = []
        self.launches = []
        self.forks = 0  # the events recorded on the caller's stream so far

    def get_current_stream(self):
        return self.current

    def Stream(self, non_blocking=False):  # noqa: N802 (cupy.cuda's name)
        assert non_blocking, "a part's stream must not wait for the legacy default stream's work"
        self.parts.append(FakeStream(self, f"part {len(self.parts)}"))
        return self.parts[-1]

    def Event(self, disable_timing=False):  # noqa: N802
        return FakeEvent()

    def Device(self, device_id):  # noqa: N802
        return nullcontext()

    def launched(self, name):
        """Note a kernel launch on the current stream."""
        s = self.current
        launch = Launch(len(self.launches), name, s, self.forks, frozenset(s.after))
        self.launches.append(launch)
        s.after.add(launch.index)

    def recording(self, launch, name=None):
        """``launch`` (a function) noting each call first as a launch of ``name`` (None: of the kernel
        that its first argument is: ``numbasplat.cuda.launch.Kernel.__getitem__``)."""
        def recorded(*args, **kwargs):
            self.launched(name if name is not None else args[0].fn.__name__)
            return launch(*args, **kwargs)
        return recorded

    def unordered(self):
        """The pairs (earlier, later) of launches that the GPU may run at once but for which nothing
        allows it: not two parts' launches of one operator."""
        bad = []
        for later in self.launches:
            for earlier in self.launches[:later.index]:
                side_by_side = (earlier.stream is not later.stream and earlier.window == later.window
                                and self.caller not in (earlier.stream, later.stream))
                if earlier.index not in later.after and not side_by_side:
                    bad.append((earlier, later))
        return bad

    def windows(self):
        """{window: the part streams that launched in it}: the operators whose parts ran side by side."""
        out = {}
        for launch in self.launches:
            if launch.stream is not self.caller:
                out.setdefault(launch.window, set()).add(launch.stream.name)
        return out
