"""The preemption signal handler of CheckpointCallback (training.py's docstring says why).

It only records the signal: a save from inside a handler could run in the middle of an
optimizer step. Handing the signal on puts the previous handlers back and raises it again, so
a loop that ignores the flag still dies as it would have, only later, with its step committed.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

_SignalHandler = Callable[[int, "FrameType | None"], Any] | int | None


class PreemptionSignals:
    """Records the first of ``signals``; a second one is handed on at once."""

    def __init__(self, signals: Sequence[int]) -> None:
        self.received: int | None = None
        """The signal that arrived, or None."""
        self.passed_on = False
        """Whether the signal was handed on to the previous handlers."""
        self._closed = False
        self._previous: dict[int, _SignalHandler] = {}
        self._install(signals)

    def _install(self, signals: Sequence[int]) -> None:
        if not signals:
            return
        if threading.current_thread() is not threading.main_thread():
            log.warning(
                "CheckpointCallback created outside the main thread: no preemption handler "
                "(signal handlers can only be set from the main thread)"
            )
            return
        for number in signals:
            self._previous[number] = signal.signal(number, self.handle)

    def handle(self, number: int, frame: FrameType | None) -> None:
        """The handler installed for each of the signals: records the first, hands a second
        (or any, once uninstalled) on."""
        if self._closed:  # closed while a later handler was on top, which put this one back
            self._forward(number, frame)
        elif self.received is not None:  # a second signal: do what was done before us, now
            self.pass_on(number)
        else:
            self.received = number

    def pass_on(self, number: int | None = None) -> None:
        """Put the previous handlers back and raise the signal again, once."""
        number = number if number is not None else self.received
        self.passed_on = True
        self.uninstall()
        if number is not None:
            signal.raise_signal(number)

    def _forward(self, number: int, frame: FrameType | None) -> None:
        previous = self._previous.get(number)
        if callable(previous):
            previous(number, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(number, signal.SIG_DFL)
            signal.raise_signal(number)

    def uninstall(self) -> None:
        """Put back each previous handler where this one is still on top; elsewhere this
        handler stays in the chain, and forwards what it gets from now on."""
        self._closed = True
        for number, previous in self._previous.items():
            if signal.getsignal(number) == self.handle:
                signal.signal(number, signal.SIG_DFL if previous is None else previous)
