"""metrics.jsonl: one JSON object per round, truncated on resume."""
from __future__ import annotations

import json
import math
import os
from typing import Dict, List


def _clean(value):
  if isinstance(value, float) and not math.isfinite(value):
    return None if math.isnan(value) else ('inf' if value > 0 else '-inf')
  return value


class MetricsWriter:
  """Appends per-round metrics to ``<directory>/metrics.jsonl``."""

  def __init__(self, directory: str, resume_round: int | None):
    self.path = os.path.join(directory, 'metrics.jsonl')
    kept = [r for r in read_metrics(self.path)
            if resume_round is not None and r['round'] <= resume_round]
    with open(self.path, 'w') as f:
      for record in kept:
        f.write(json.dumps(record) + '\n')

  def write(self, record: Dict) -> None:
    with open(self.path, 'a') as f:
      f.write(json.dumps({k: _clean(v) for k, v in record.items()}) + '\n')
      f.flush()
      os.fsync(f.fileno())


def read_metrics(path: str) -> List[Dict]:
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        try:
          records.append(json.loads(line))
        except json.JSONDecodeError:
          break  # a line cut by a kill: drop it and everything after
  return records
