// bind_shm.cc — Python binding of the shared-memory engine (mlfabric._C.ShmEngine). Arguments are
// converted while holding the GIL; the engine runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>

#include "shm_engine.h"

namespace py = pybind11;

namespace mlf {

void bind_shm(py::module_& m) {
  py::class_<ShmEngine>(m, "ShmEngine")
      .def(py::init<uintptr_t, size_t, int, int, size_t, int, double>(), py::arg("base"),
           py::arg("nbytes"), py::arg("rank"), py::arg("nranks"), py::arg("block_bytes"),
           py::arg("slots"), py::arg("timeout_s"))
      .def_static("required_bytes", &ShmEngine::required_bytes)
      .def("reset_segment", &ShmEngine::reset_segment)
      .def(
          "run",
          [](ShmEngine& self, int kind, int dtype, int op, double scale, int root,
             const std::optional<py::array>& in, std::optional<py::array>& out, size_t count,
             std::vector<size_t> chunks, std::vector<int64_t> header,
             std::vector<uintptr_t> peer_in, std::vector<uintptr_t> peer_out) {
            // Arrays are C-contiguous views made by mlfabric._core.buffers; their addresses are
            // read here, which is cheaper than asking numpy for them in Python.
            CallArgs a;
            a.kind = static_cast<Kind>(kind);
            a.dtype = static_cast<DType>(dtype);
            a.op = static_cast<RedOp>(op);
            a.scale = scale;
            a.root = root;
            a.in = in ? static_cast<const char*>(in->data()) : nullptr;
            a.out = out ? static_cast<char*>(out->mutable_data()) : nullptr;
            a.count = count;
            a.chunks = std::move(chunks);
            a.header = std::move(header);
            a.peer_in = std::move(peer_in);
            a.peer_out = std::move(peer_out);
            CallResult r;
            {
              py::gil_scoped_release nogil;
              r = self.run(a);
            }
            return py::make_tuple(r.status, r.zero_copy, r.message);
          },
          "Run one collective; returns (status, zero_copy, message). status 0 ok, 1 header "
          "mismatch (see headers()), 2 timeout, 3 other failure (the engine is unusable after 2 "
          "or 3).")
      .def(
          "add_plan",
          [](ShmEngine& self, int kind, int dtype, int op, double scale, std::vector<int64_t> header) {
            CallArgs a;
            a.kind = static_cast<Kind>(kind);
            a.dtype = static_cast<DType>(dtype);
            a.op = static_cast<RedOp>(op);
            a.scale = scale;
            a.header = std::move(header);
            return self.add_plan(std::move(a));
          },
          "Prepare a repeated call (no zero-copy); returns the index for run_plan().")
      .def(
          "run_plan",
          [](ShmEngine& self, int index, const py::array& in, py::array& out) {
            // The hot path: C-contiguous arrays of the plan's dtype and the same size (the
            // caller checks dtype and shape; contiguity and a writeable out are checked here).
            // Returns -1 without touching the engine when they fail (the general path then
            // rejects the call on every rank), else run()'s status; the
            // message of a failure is in last_message.
            constexpr int kC = py::array::c_style;
            if ((in.flags() & kC) != kC || (out.flags() & kC) != kC || !out.writeable()) return -1;
            CallArgs& a = self.plan(static_cast<size_t>(index));
            a.in = static_cast<const char*>(in.data());
            a.out = static_cast<char*>(out.mutable_data());
            a.count = static_cast<size_t>(in.size());
            CallResult r;
            {
              py::gil_scoped_release nogil;
              r = self.run(a);
            }
            self.last_message = r.message;
            return r.status;
          },
          py::arg("index"), py::arg("in").noconvert(), py::arg("out").noconvert())
      .def_readonly("last_message", &ShmEngine::last_message)
      .def("probe_publish", &ShmEngine::probe_publish)
      .def("probe_peers", &ShmEngine::probe_peers, py::call_guard<py::gil_scoped_release>())
      .def("enable_cma", &ShmEngine::enable_cma, py::arg("on"), py::arg("min_bytes"),
           py::arg("max_bytes"))
      .def_property_readonly("cma_enabled", &ShmEngine::cma_enabled)
      .def_property_readonly("cma_calls", &ShmEngine::cma_calls)
      .def("headers", &ShmEngine::headers)
      .def("abandon", &ShmEngine::abandon, py::arg("status"))
      .def_property_readonly("broken", &ShmEngine::broken)
      .def_property_readonly("any_failed", &ShmEngine::any_failed);
}

}  // namespace mlf
