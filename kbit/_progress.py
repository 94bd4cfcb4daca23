"""Progress of a loop over layers, readable on a terminal and in a log file alike.

On a terminal it is a tqdm bar. Elsewhere (a log file, a CI job, a pipe) a bar's carriage-return redraws pile
up into one unreadable line, so it reports a plain line at every tenth of the work instead.
"""

from __future__ import annotations

import sys
from typing import Callable, Optional

__all__ = ["Progress", "is_terminal"]


class Progress:
    """``update()`` once per item, ``close(summary)`` at the end; silent when not ``enabled``.

    ``bar=False`` always reports lines; ``log`` receives them (default: printed to stderr).
    """

    def __init__(self, total: int, desc: str, enabled: bool = True, bar: bool = True,
                 log: Optional[Callable[[str], None]] = None):
        self.total, self.desc, self.done = total, desc, 0
        self.enabled = enabled and total > 0
        self.log = log if log is not None else _print_to_stderr
        self._bar = None
        self._next_tenth = 1
        if self.enabled and bar and is_terminal(sys.stderr):
            try:
                from tqdm.auto import tqdm
            except ImportError:  # tqdm is optional: report lines instead
                tqdm = None
            if tqdm is not None:
                self._bar = tqdm(total=total, desc=desc, unit="layer", leave=False)

    def update(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
        elif self.done * 10 >= self._next_tenth * self.total:
            while self.done * 10 >= self._next_tenth * self.total:
                self._next_tenth += 1
            self.log(f"{self.desc}: {self.done}/{self.total} ({100 * self.done // self.total}%)")

    def close(self, summary: Optional[str] = None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self.enabled and summary:
            self.log(summary)


def _print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
