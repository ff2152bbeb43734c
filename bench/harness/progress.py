"""A progress bar on stderr: ``tqdm`` on a terminal when installed, else a plain fallback.

On a terminal the bar redraws in place; in a log (stderr not a TTY) it prints a
line at every 10 % instead, so captured output stays readable.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """``bar = Progress(total); bar.set(desc); bar.advance(); bar.close()``; silent when ``enabled=False``."""

    def __init__(self, total: int, enabled: bool = True, stream=None):
        self.total = max(1, int(total))
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.desc = ""
        self.start = time.perf_counter()
        self._last_decile = -1
        self._tqdm = None
        if enabled and self.tty:
            try:
                from tqdm import tqdm

                self._tqdm = tqdm(total=self.total, file=self.stream, dynamic_ncols=True, leave=False,
                                  bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]")
            except ImportError:
                self._tqdm = None

    def add(self, n: int) -> None:
        """Grow (or shrink) the total: work discovered while running."""
        self.total = max(1, self.total + n)
        if self._tqdm is not None:
            self._tqdm.total = self.total
            self._tqdm.refresh()

    def set(self, desc: str) -> None:
        self.desc = desc
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.set_description_str(desc, refresh=True)
        elif self.tty:
            self._draw()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.update(n)
        elif self.tty:
            self._draw()
        else:
            decile = int(10 * min(self.done, self.total) / self.total)
            if decile > self._last_decile:
                self._last_decile = decile
                elapsed = time.perf_counter() - self.start
                self.stream.write(f"[{10 * decile:3d}%] {self.done}/{self.total} points, {elapsed:.0f} s: "
                                  f"{self.desc}\n")
                self.stream.flush()

    def _draw(self) -> None:
        width = 24
        filled = int(width * min(self.done, self.total) / self.total)
        elapsed = time.perf_counter() - self.start
        line = f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {elapsed:5.0f}s {self.desc}"
        self.stream.write(line[:120].ljust(120))
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
        elif self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
