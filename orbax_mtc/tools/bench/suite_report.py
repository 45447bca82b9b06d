"""The tables and plot of `orbax-mtc bench suite` from its summarized rows (see `suite`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orbax_mtc.tools.bench import plotting


def _fmt(value: float, digits: int = 2, suffix: str = "") -> str:
  if value is None or value != value:
    return "-"
  return f"{value:.{digits}f}{suffix}"


def markdown(rows: Sequence[dict[str, Any]], skipped: Sequence[dict[str, Any]],
             command: str) -> str:
  """The ratio tables (pure)."""
  backends = sorted({r.get("backend", "cpu") + (
      f" ({r['device_kind']})" if r.get("device_kind") not in (None, r.get("backend", "cpu"))
      else "") for r in rows})
  on_device = any(r.get("blocking_limit") == "device-to-host copy" for r in rows)
  blocking_header = "blocking / device-to-host copy" if on_device else "blocking / memcpy"
  lines = [f"`{command}`", ""]
  if backends:
    lines += [f"Arrays on: {', '.join(backends)}." + (
        " Every save starts from a fresh device copy of the state (no host copy cached); "
        "the save's blocking time is held to a device-to-host copy of the state."
        if on_device else ""), ""]
  lines += ["Targets (slowest process; each of our figures against its limit measured beside "
            "it in the same repetition, median over the repetitions):", "",
            "| procs | MiB/proc | local save / raw write (≥0.6) | restore / raw read (≥0.6) | "
            f"{blocking_header} (≤1.25) | recovery / local restore (≤1.5): ring, twin | "
           "loop overhead (≤5 %): local, peers | replication / ppermute |",
           "|---|---|---|---|---|---|---|---|"]

  def mark(row, key, digits=2, pct=False):
    target = row["targets"].get(key)
    value = row["ratios"].get(key, float("nan"))
    text = _fmt(100 * value, 1, " %") if pct else _fmt(value, digits, "x")
    if target is not None and value == value:
      text += " ✓" if target["met"] else " ✗"
    return text

  for row in rows:
    r = row["ratios"]
    lines.append(
        f"| {row['procs']} | {row['mib']} | {mark(row, 'local save / raw write')} | "
        f"{mark(row, 'restore / raw read')} | {mark(row, 'save blocking / memcpy')} | "
        f"{mark(row, 'recovery / local restore (ring)')}, "
        f"{mark(row, 'recovery / local restore (twin)')} | "
        f"{mark(row, 'loop overhead, local save every 10 steps', pct=True)}, "
        f"{_fmt(100 * r.get('loop overhead, with peers', float('nan')), 1, ' %')} | "
        f"{_fmt(r.get('replication / raw ppermute', float('nan')), 2, 'x')} |")
  lines += ["", "orbax-mtc against Orbax on the same RAM disk (higher is better for orbax-mtc):",
            "", "| procs | MiB/proc | save vs ocp.CheckpointManager | restore vs "
            "ocp.CheckpointManager | blocking: Orbax / ours | save vs emergency | restore vs "
            "emergency | blocking: emergency / ours | SIGTERM -> durable |",
            "|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    r = row["ratios"]
    lines.append(
        f"| {row['procs']} | {row['mib']} | {_fmt(r.get('mtc_save / orbax_save'), 2, 'x')} | "
        f"{_fmt(r.get('mtc_restore / orbax_restore'), 2, 'x')} | "
        f"{_fmt(r.get('orbax_blocking / mtc_blocking'), 1, 'x')} | "
        f"{_fmt(r.get('mtc_save / emergency_save'), 2, 'x')} | "
        f"{_fmt(r.get('mtc_restore / emergency_restore'), 2, 'x')} | "
        f"{_fmt(r.get('emergency_blocking / mtc_blocking'), 1, 'x')} | "
        f"{_fmt(row.get('ondemand_s'), 2, ' s')} |")
  lines += ["", "orbax-mtc against Orbax's P2P manager (`experimental.emergency.p2p`) on the same "
            "RAM disk (higher is better for orbax-mtc; recovery: a node whose RAM folder was "
            "lost, two replicas; P2P's figure includes building its manager, where its peer "
            "fetch starts, shown after it):", "",
            "| procs | MiB/proc | save vs P2P | restore vs P2P | blocking: P2P / ours | "
            "recovery: P2P / ours | P2P save / restore GB/s | P2P recovery (of it: build) |",
            "|---|---|---|---|---|---|---|---|"]
  for row in rows:
    r = row["ratios"]
    lines.append(
        f"| {row['procs']} | {row['mib']} | {_fmt(r.get('mtc_save / p2p_save'), 2, 'x')} | "
        f"{_fmt(r.get('mtc_restore / p2p_restore'), 2, 'x')} | "
        f"{_fmt(r.get('p2p_blocking / mtc_blocking'), 1, 'x')} | "
        f"{_fmt(r.get('p2p_recovery / mtc_recovery (twin)'), 2, 'x')} | "
        f"{_fmt(row.get('p2p_save_gbps'))} / {_fmt(row.get('p2p_restore_gbps'))} | "
        f"{_fmt(row.get('p2p_recovery_s'), 2, ' s')} "
        f"({_fmt(row.get('p2p_recovery_build_s'), 2, ' s')}) |")
  lines += ["", "Bandwidths, GB/s per process (median):", "",
            f"| procs | MiB/proc | {'memcpy / device-to-host' if on_device else 'memcpy'} | "
            "raw write new / overwrite | raw read | ppermute | "
            "broadcast | ours save | ours restore | Orbax save / restore | emergency save / "
            "restore | ours blocking | replication ring |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    g = row.get
    lines.append(
        f"| {row['procs']} | {row['mib']} | {_fmt(g('memcpy_gbps'), 1)}"
        f"{' / ' + _fmt(g('d2h_gbps')) if on_device else ''} | "
        f"{_fmt(g('raw_write_new_gbps'))} / {_fmt(g('raw_write_overwrite_gbps'))} | "
        f"{_fmt(g('raw_read_gbps'))} | {_fmt(g('raw_ppermute_gbps'))} | "
        f"{_fmt(g('raw_broadcast_gbps'))} | {_fmt(g('mtc_save_gbps'))} | "
        f"{_fmt(g('mtc_restore_gbps'))} | {_fmt(g('orbax_save_gbps'))} / "
        f"{_fmt(g('orbax_restore_gbps'))} | {_fmt(g('emergency_save_gbps'))} / "
        f"{_fmt(g('emergency_restore_gbps'))} | {_fmt(1e3 * g('mtc_blocking_s', float('nan')), 1, ' ms')} | "
        f"{_fmt(g('replication_ring_gbps'))} |")
  if skipped:
    lines += ["", "Skipped: " + "; ".join(
        f"{s['procs']} x {s['mib']} MiB ({s['why']})" for s in skipped) + "."]
  names = {"emergency": "Orbax emergency", "p2p": "Orbax P2P"}
  notes = sorted({(names.get(k, k), v) for row in rows for k, v in row.get("notes", {}).items()})
  if notes:
    lines += ["", "Notes: " + " ".join(f"{name}: {note}." for name, note in notes)]
  return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: Path) -> str | None:
  """Bandwidth vs state size, one panel per process count; returns why not, if not."""
  plt = plotting.pyplot()
  if plt is None:
    return plotting.NOT_INSTALLED
  procs = sorted({r["procs"] for r in rows})
  fig, axes = plt.subplots(1, len(procs), figsize=(5 * len(procs), 4), squeeze=False)
  series = [("raw_write_overwrite_gbps", "raw write (overwrite)", "k--"),
            ("raw_read_gbps", "raw read", "k:"),
            ("mtc_save_gbps", "orbax-mtc save", "C0-o"),
            ("mtc_restore_gbps", "orbax-mtc restore", "C0-s"),
            ("orbax_save_gbps", "Orbax save", "C1-o"),
            ("orbax_restore_gbps", "Orbax restore", "C1-s"),
            ("emergency_save_gbps", "Orbax emergency save", "C2-o"),
            ("emergency_restore_gbps", "Orbax emergency restore", "C2-s"),
            ("p2p_save_gbps", "Orbax P2P save", "C4-o"),
            ("p2p_restore_gbps", "Orbax P2P restore", "C4-s"),
            ("replication_ring_gbps", "orbax-mtc replication", "C3-^"),
            ("raw_ppermute_gbps", "raw ppermute", "C3:")]
  for ax, n in zip(axes[0], procs, strict=True):
    mine = sorted((r for r in rows if r["procs"] == n), key=lambda r: r["mib"])
    for key, label, style in series:
      points = [(r["mib"], r[key]) for r in mine if key in r]
      if points:
        ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("state per process (MiB)")
    ax.set_ylabel("GB/s per process")
    ax.set_title(f"{n} process{'es' if n > 1 else ''}")
    ax.grid(True, alpha=0.3)
  # One legend for all panels, below them: inside a panel it covered the curves.
  handles, labels = axes[0][-1].get_legend_handles_labels()
  fig.legend(handles, labels, loc="lower center", ncol=5, fontsize=8, frameon=False)
  fig.tight_layout(rect=(0, 0.14, 1, 1))
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return None
