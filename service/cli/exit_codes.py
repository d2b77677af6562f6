"""The exit codes of the verdict commands (`submit --wait`, `verify`, `retry --wait`, `check`): one
place, read by service.cli.common (which decides a run's code) and service.cli.report (which
prints it beside a no-baseline run)."""

EXIT_OK = 0               # unchanged, a change a maintainer acknowledged, or an allowed no-baseline
EXIT_CHANGED = 1          # a trajectory changed
EXIT_USAGE = 2            # bad input or usage: an option, a file, a folder, a 4xx from the service
EXIT_BROKEN = 3           # the commit's fault: it does not build, its kernels crash, hang or go NaN
EXIT_OPTDRIFT_ERROR = 4   # optdrift's fault: service unreachable, 5xx, a run in status `error`
EXIT_NONDETERMINISTIC = 5  # a kernel does not reproduce itself on the same build
# Nothing to compare with: no commit on the first-parent line has a finished run in the environment
# (issue 44: never a silent pass). `submit --allow-no-baseline` (a project's first commit) makes it 0.
EXIT_NO_BASELINE = 7  # not 6: `optdrift speed --fail-on-slowdown` says "slower" with 6
# The tree refuses this environment's toolchain ("CUDA Version > 12 is not supported" in its CMake):
# nothing was checked, and neither the commit (3) nor optdrift (4) failed (issue 47;
# service/core/not_buildable.py, worker/build/refusal.py).
EXIT_NOT_BUILDABLE = 8
