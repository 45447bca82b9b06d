"""The launcher's report of a suite run (run_suite.py): every rank's outcome per test, merged
into one, written to summary.json and printed."""

import collections
import json
import os
import shutil


def _read_jsonl(path):
  out = {}
  if os.path.exists(path):
    with open(path) as f:
      for line in f:
        line = line.strip()
        if line:
          try:
            rec = json.loads(line)
          except json.JSONDecodeError:
            continue
          out[rec['nodeid']] = rec
  return out


def summarize(args, out, tmpdir, returncodes, wall):
  """Merges the ranks' outcomes, writes summary.json, prints the report; the exit code."""
  n = args.num_processes
  per_rank = [_read_jsonl(os.path.join(out, f'rank{r}.jsonl'))
              for r in range(n)]
  collected = []
  for r in range(n):
    path = os.path.join(out, f'rank{r}.collected.json')
    if os.path.exists(path):
      with open(path) as f:
        collected = json.load(f)
      break
  order = list(collected) or sorted(set().union(*per_rank))

  merged = collections.OrderedDict()
  for nodeid in order:
    recs = [pr.get(nodeid) for pr in per_rank]
    outcomes = [rec['outcome'] if rec else 'not-run' for rec in recs]
    if all(o == 'passed' for o in outcomes):
      final, reason = 'passed', ''
    elif all(o == 'skipped' for o in outcomes):
      final, reason = 'skipped', recs[0]['reason']
    else:
      bad = [(r, rec) for r, rec in enumerate(recs)
             if rec is None or rec['outcome'] in ('failed', 'error')]
      if not bad:  # mix of passed / skipped across ranks
        bad = [(r, rec) for r, rec in enumerate(recs)
               if rec['outcome'] != 'passed']
      r, rec = bad[0]
      final = 'not-run' if rec is None else rec['outcome']
      if final == 'skipped':
        final = 'failed'
      reason = (f'rank {r}: ' + ('not run (worker died or timed out)'
                                 if rec is None else rec['reason']))
    merged[nodeid] = {'outcome': final, 'reason': reason,
                      'per_rank': outcomes,
                      'constructed': (recs[0] or {}).get('constructed')}

  counts = collections.Counter(m['outcome'] for m in merged.values())
  with open(os.path.join(out, 'summary.json'), 'w') as f:
    json.dump({'returncodes': returncodes, 'wall_s': round(wall, 1),
               'num_processes': n, 'cm': args.cm, 'counts': counts,
               'tests': merged}, f, indent=1)

  print(f'worker return codes: {returncodes}; wall {wall:.0f}s')
  bad = [(k, v) for k, v in merged.items()
         if v['outcome'] not in ('passed', 'skipped')]
  if bad:
    print(f'--- {len(bad)} failing / erroring / not-run tests ---')
    for nodeid, v in bad:
      print(f'{v["outcome"].upper():8s} {nodeid.split("::")[-1]}: '
            f'{v["reason"]}')
  skipped = [(k, v) for k, v in merged.items() if v['outcome'] == 'skipped']
  if skipped:
    print(f'--- {len(skipped)} skipped ---')
    for nodeid, v in skipped:
      print(f'SKIPPED  {nodeid.split("::")[-1]}: {v["reason"]}')
  if args.count_constructions:
    no_cls = [k.split('::')[-1] for k, v in merged.items()
              if v['constructed'] and v['constructed']['under_test'] == 0
              and v['outcome'] == 'passed']
    tot = collections.Counter()
    for v in merged.values():
      tot.update(v['constructed'] or {})
    print(f'constructions (rank 0): {dict(tot)}; '
          f'{len(no_cls)} passing tests never built the class under test')
  if not args.keep_tmp:
    shutil.rmtree(tmpdir, ignore_errors=True)
  print(f'errors: {counts["error"]}, not run: {counts["not-run"]}, '
        f'collected: {len(merged)}')
  failed = counts['failed'] + counts['error'] + counts['not-run']
  print(f'{counts["passed"]} passed, {failed} failed, '
        f'{counts["skipped"]} skipped', flush=True)
  return 0 if failed == 0 and merged else 1
