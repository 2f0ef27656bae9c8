"""How a kept package's C++ is compiled: the wrapper beside the kernels, and without checks that never run.

AOTInductor writes each exported step as two C++ files and compiles them one after the
other: the wrapper (the host code that allocates buffers, fills the constants table and
calls each kernel; 10-20 thousand lines at -O1) and the kernels (-O3), then links them.
For the default model's float32 decode step on two cores that was 11.2 s and then 6.2 s
of g++, a third of a 58 s build, on one core while the other waited. Two changes, both
applied only inside `faster_package_build()` (the kept-graph builder's,
`graph_store.build_entry`), make it 8.5 s beside 6.1 and the build 49 s (same hour). (The
rest of that build, measured in one process on the course's 2-core Xeon: `torch.export` 4-5 s,
Inductor's own Python work, lowering, fusing and writing a matvec kernel per weight shape,
about 28 s.)

1. The wrapper compiles in a thread of its own while the kernels and the constants
   compile: g++ is a separate process, so two cores run both and the critical path is the
   wrapper's alone. The link, and any other build that needs the objects, waits for it.
2. The wrapper's per-input checks are left out. AOTInductor writes one function per input
   (64 for the decode step: dtype, every size and stride, the device) and compiles them
   always, but runs them only when the environment sets AOTI_RUNTIME_CHECK_INPUTS: 3 s of
   g++ for code that never runs here. The runner passes the tensors the step was
   exported with (`step_shapes`), so a mismatch is a bug in this package, not user input.

Both are patches to torch's internals (`CppBuilder.build`, `CppWrapperCpu.
generate_input_output_runtime_checks`), made while the context is open and undone when it
closes, as `inductor_settings` patches Inductor's templates (`inductor.torch_patch`); where
torch no longer has them, nothing is patched and the build runs as torch wrote it. A package
runs the same either way (the checks never run), so whether they took is not part of a
kept graph's key.
"""

from __future__ import annotations

import contextlib
import threading

from .inductor import torch_patch

# The empty check AOTInductor's `run_impl` still calls (its signature as torch writes it), and the switch its
# in-line size asserts still read.
NO_CHECKS = """
static bool _check_aoti_runtime_check_inputs_env() {
    const static char* env_var_value = getenv("AOTI_RUNTIME_CHECK_INPUTS");
    const static bool result = env_var_value != nullptr && env_var_value[0] != '0';
    return result;
}

AOTI_NOINLINE static void __check_inputs_outputs(
    AtenTensorHandle* input_handles,
    AtenTensorHandle* output_handles) {}
"""


class _Background:
    """One g++ run in a thread; `join` waits for it and raises its error, if it had one."""

    def __init__(self, build, builder):
        self.error: BaseException | None = None

        def run():
            try:
                build(builder)
            except BaseException as e:  # handed to the thread that waits for it
                self.error = e

        self.thread = threading.Thread(target=run, name="minillm-wrapper-g++", daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def _finish(pending: list) -> None:
    """Wait for every background compile; the first error is raised once all have stopped."""
    errors = []
    while pending:
        try:
            pending.pop(0).join()
        except BaseException as e:
            errors.append(e)
    if errors:
        raise errors[0]


@contextlib.contextmanager
def faster_package_build():
    """Inside: AOTInductor's builds compile the wrapper beside the kernels and leave out its input checks.

    On leaving, every background compile has finished (on an error too: nothing keeps writing
    into a folder the caller is about to remove)."""
    pending: list[_Background] = []  # the wrapper compiles running in the background

    def beside(build):
        def build_beside(builder) -> None:  # `CppBuilder.build`
            compile_only = getattr(builder, "_compile_only", False)
            if compile_only and str(getattr(builder, "_target_file", "")).endswith(".wrapper.o"):
                pending.append(_Background(build, builder))
                return None
            if not compile_only:  # a link (or a header, or a preprocessor run) may need the objects
                _finish(pending)
            return build(builder)

        return build_beside

    def without_checks(_checks):
        return lambda writer: writer.prefix.splice_aot(NO_CHECKS)  # `generate_input_output_runtime_checks`

    try:
        with (torch_patch("torch._inductor.cpp_builder", "CppBuilder", "build", beside),
              torch_patch("torch._inductor.codegen.cpp_wrapper_cpu", "CppWrapperCpu",
                          "generate_input_output_runtime_checks", without_checks)):
            yield
    except BaseException:
        with contextlib.suppress(BaseException):  # the body's error is the one to see
            _finish(pending)
        raise
    _finish(pending)


__all__ = ["NO_CHECKS", "faster_package_build"]
