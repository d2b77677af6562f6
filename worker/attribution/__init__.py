"""Attribution of a changed case (issue 17): how big the change is in ulps of the parameter, and
which semantic change of the algorithm, if any, the commit's trajectory follows.

  ulps.py       ulps and ulp distances of float32 / float16 / bfloat16 values (numpy)
  variants.py   the catalogue of float64 algorithm variants (decay after the update, eps inside
                the square root, ...) and their replay over a case's exact gradients (torch)
  analysis.py   one case: commit and baseline parameters per step -> the attribution (torch), in
                four phases:
  reading.py      the trajectories in ulps of each element's scale, the states compared
  rounding.py     the rounding test: within rounding, a quantizer change, or nothing to attribute
  matching.py     the variant match: the catalogued variant that explains commit − baseline
  drift_call.py   a case within rounding that drifts one way below one ulp, and its variant
  states.py     the optimizer state beside the parameters: codes, scales, float states compared
  drift.py      a change within rounding that moves one way: the sign test and the sub-ulp naming
  child.py      the analysis in a child process, for a worker process that must not import torch
  pair_run.py   re-runs the changed cases' kernels on both builds (kernel hosts) and asks the child
"""
