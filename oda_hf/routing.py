"""What routing did during one request: per-row decisions, scores and the Full-call rate."""

from __future__ import annotations

import torch


class RoutingRecord:
    """Decisions of one request (one `generate()` call or one manual prefill + decode loop).

    * ``decisions``: bool ``[batch, routed_steps]``, True = Full. The output produced by prefill is
      not a routed step. Steps a row took after it finished (EOS or a stopping criterion) are masked
      out through ``valid``.
    * ``scores``: float ``[batch, routed_steps]`` head scores (NaN where nothing was decided: no head, or in the window).
    * ``valid``: bool ``[batch, routed_steps]``; ``steps_per_row`` and every rate count only valid steps.
    * ``in_window``: bool ``[batch, routed_steps]``, True where the row's history (committed positions plus
      the current token) was within ``sinks + window``: Local and Full read the same positions there, so
      the step's result is the same either way and nothing is decided. Such a step counts as Local (as
      Full for policies that never run Local, the always-Full control), with a NaN score.

    Two rates, both pooled over rows and valid steps:

    * ``full_call_rate``: Full decisions / steps past the window (``decided_steps_per_row``), the steps
      where routing can change the result. This is the rate routing is calibrated and compared on.
    * ``paper_full_call_rate``: Full decisions / all routed steps (every step after the prefill, as the
      paper counts them; in-window steps count as Local unless the policy never runs Local).

    ``routed_steps`` stays the number of steps taken after the prefill (the paper's routed steps).
    """

    def __init__(self, batch_size: int = 0):
        self.batch_size = batch_size
        self._decisions: list[torch.Tensor] = []
        self._scores: list[torch.Tensor] = []
        self._in_window: list[torch.Tensor] = []
        self.finished_at = torch.full((batch_size,), -1, dtype=torch.long)  # routed steps taken when finished

    def record(self, decisions: torch.Tensor, scores: torch.Tensor | None, in_window: torch.Tensor | None = None) -> None:
        """One step: decisions ``[batch]``, head scores (None: the head did not run), rows within the window."""
        decisions = decisions.detach().to("cpu", torch.bool)
        self._decisions.append(decisions)
        if in_window is None:
            in_window = torch.zeros(decisions.shape, dtype=torch.bool)
        in_window = in_window.detach().to("cpu", torch.bool)
        if scores is None:
            scores = torch.full(decisions.shape, float("nan"))
        # the head also runs for rows still within the window when another row is past it: nothing was decided there
        self._scores.append(scores.detach().to("cpu", torch.float32).masked_fill(in_window, float("nan")))
        self._in_window.append(in_window)

    def reorder(self, indices: torch.Tensor) -> None:
        """Follow a beam reorder: history of row i becomes that of row indices[i]."""
        indices = indices.cpu()
        self._decisions = [d[indices] for d in self._decisions]
        self._scores = [s[indices] for s in self._scores]
        self._in_window = [w[indices] for w in self._in_window]
        self.finished_at = self.finished_at[indices]

    def drop_last_steps(self, count: int) -> None:
        """Forget the last `count` steps (their tokens were taken back); rows finished in them are finished at the
        end of the steps kept."""
        kept = max(self.routed_steps - count, 0)
        del self._decisions[kept:], self._scores[kept:], self._in_window[kept:]
        self.finished_at = torch.where(self.finished_at > kept, torch.tensor(kept), self.finished_at)

    def mark_finished(self, rows: torch.Tensor) -> None:
        """Rows (bool ``[batch]``) that are finished after the steps recorded so far."""
        rows = rows.detach().cpu().bool()
        newly = rows & (self.finished_at < 0)
        self.finished_at[newly] = self.routed_steps

    @property
    def routed_steps(self) -> int:
        return len(self._decisions)

    @property
    def decisions(self) -> torch.Tensor:
        if not self._decisions:
            return torch.zeros(self.batch_size, 0, dtype=torch.bool)
        return torch.stack(self._decisions, dim=1)

    @property
    def scores(self) -> torch.Tensor:
        if not self._scores:
            return torch.zeros(self.batch_size, 0)
        return torch.stack(self._scores, dim=1)

    @property
    def in_window(self) -> torch.Tensor:
        if not self._in_window:
            return torch.zeros(self.batch_size, 0, dtype=torch.bool)
        return torch.stack(self._in_window, dim=1)

    @property
    def valid(self) -> torch.Tensor:
        steps = torch.arange(self.routed_steps)[None, :]
        limit = torch.where(self.finished_at >= 0, self.finished_at, torch.tensor(self.routed_steps))
        return steps < limit[:, None]

    @property
    def steps_per_row(self) -> torch.Tensor:
        return self.valid.sum(dim=1)

    @property
    def full_calls_per_row(self) -> torch.Tensor:
        return (self.decisions & self.valid).sum(dim=1)

    @property
    def window_steps_per_row(self) -> torch.Tensor:
        """Valid steps whose history was within sinks + window (not decided: Local and Full agree)."""
        return (self.in_window & self.valid).sum(dim=1)

    @property
    def window_full_calls_per_row(self) -> torch.Tensor:
        """Full calls on in-window steps (only policies that never run Local make them)."""
        return (self.decisions & self.in_window & self.valid).sum(dim=1)

    @property
    def decided_steps_per_row(self) -> torch.Tensor:
        """Valid steps past the window: the steps routing decides."""
        return self.steps_per_row - self.window_steps_per_row

    @property
    def full_call_rate(self) -> float:
        """Pooled rate over the steps past the window: Full decisions there / those steps (NaN with none)."""
        steps = int(self.decided_steps_per_row.sum())
        calls = int(self.full_calls_per_row.sum()) - int(self.window_full_calls_per_row.sum())
        return calls / steps if steps else float("nan")

    @property
    def paper_full_call_rate(self) -> float:
        """The paper's pooled rate: Full decisions / all routed steps (in-window steps count as Local unless the
        policy never runs Local). NaN with no routed step."""
        steps = int(self.steps_per_row.sum())
        return float(self.full_calls_per_row.sum()) / steps if steps else float("nan")

    def summary(self) -> str:
        def percent(rate: float) -> str:   # (NaN: no step to count, e.g. every step within sinks + window)
            return "n/a" if rate != rate else f"{rate:.2%}"

        return (
            f"routed steps {int(self.steps_per_row.sum())} ({int(self.window_steps_per_row.sum())} within sinks + "
            f"window), Full calls {int(self.full_calls_per_row.sum())}, Full-call rate {percent(self.full_call_rate)} "
            f"past the window, {percent(self.paper_full_call_rate)} over all routed steps (paper)"
        )

    def __repr__(self) -> str:
        rows = ", ".join(f"{int(f)}/{int(n)}" for f, n in zip(self.full_calls_per_row, self.steps_per_row))
        return f"RoutingRecord(batch={self.batch_size}, full/steps per row=[{rows}], full_call_rate={self.full_call_rate:.4f})"
