// module.cc — the private native module mlfabric._C: kernels (bind_kernels.cc), the
// shared-memory collective engine (bind_shm.cc), the scheduler's fast path (bind_sched.cc), the
// bounded exit after a peer failure (exit_watchdog.cc) and the reads of many torch tensors'
// metadata at once (torch_meta.cc).
// The public API lives in Python (mlfabric/).
#include <pybind11/pybind11.h>

namespace mlf {
void bind_kernels(pybind11::module_& m);
void bind_shm(pybind11::module_& m);
void bind_sched(pybind11::module_& m);
void bind_exit_watchdog(pybind11::module_& m);
void bind_torch_meta(pybind11::module_& m);
}  // namespace mlf

PYBIND11_MODULE(_C, m) {
  m.doc() = "mlfabric native core (private; use the mlfabric package)";
  mlf::bind_kernels(m);
  mlf::bind_shm(m);
  mlf::bind_sched(m);
  mlf::bind_exit_watchdog(m);
  mlf::bind_torch_meta(m);
}
