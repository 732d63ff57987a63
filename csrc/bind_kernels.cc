// bind_kernels.cc — Python bindings of the kernels (kernels.h, and cuda_api.h when built with
// CUDA) into mlfabric._C. Buffers are raw addresses (Python ints); arguments are converted and
// checked before the kernel runs, and every kernel runs with the GIL released.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels.h"
#ifdef MLFABRIC_WITH_CUDA
#include "cuda_api.h"
#endif

namespace py = pybind11;

namespace mlf {
namespace {

// The checks throw C++ exceptions only: they run with the GIL released and pybind11 turns them
// into Python exceptions after taking it back.
DType checked_dtype(int code) {
  if (code < 0 || code >= kNumDTypes)
    throw py::value_error("bad dtype code " + std::to_string(code) + " (expected 0.." +
                          std::to_string(kNumDTypes - 1) + ")");
  return static_cast<DType>(code);
}

RedOp checked_op(int code) {
  if (code < 0 || code >= kNumOps)
    throw py::value_error("bad reduction op code " + std::to_string(code) + " (expected 0.." +
                          std::to_string(kNumOps - 1) + ")");
  return static_cast<RedOp>(code);
}

DType checked_floating(int code, const char* what) {
  DType t = checked_dtype(code);
  if (!is_floating(t)) throw py::value_error(std::string(what) + " needs a floating dtype");
  return t;
}

std::vector<const void*> checked_srcs(const std::vector<uintptr_t>& srcs, DType t, double scale) {
  if (srcs.empty()) throw py::value_error("reduce needs at least one source (k >= 1)");
  if (srcs.size() > size_t(INT32_MAX)) throw py::value_error("too many sources");
  if (scale != 1.0 && !is_floating(t))
    throw py::value_error("scale != 1 needs a floating dtype");
  std::vector<const void*> p(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) p[i] = reinterpret_cast<const void*>(srcs[i]);
  return p;
}

void* ptr(uintptr_t a) { return reinterpret_cast<void*>(a); }

#ifdef MLFABRIC_WITH_CUDA
void cuda_check(const char* err) {
  if (err) throw std::runtime_error(std::string("CUDA error: ") + err);
}
#endif

}  // namespace

void bind_kernels(py::module_& m) {
  using nogil = py::call_guard<py::gil_scoped_release>;

  m.def(
      "reduce",
      [](uintptr_t dst, const std::vector<uintptr_t>& srcs, size_t count, int dtype, int op,
         double scale) {
        DType t = checked_dtype(dtype);
        RedOp o = checked_op(op);
        auto p = checked_srcs(srcs, t, scale);
        mlf::reduce(ptr(dst), p.data(), int(p.size()), count, t, o, scale);
      },
      py::arg("dst"), py::arg("srcs"), py::arg("count"), py::arg("dtype"), py::arg("op"),
      py::arg("scale") = 1.0, nogil(),
      "dst[i] = scale * op(srcs[0][i], ..., srcs[k-1][i]); dst may alias a source exactly.");
  m.def(
      "scale",
      [](uintptr_t x, size_t count, int dtype, double alpha) {
        mlf::scale(ptr(x), count, checked_floating(dtype, "scale"), alpha);
      },
      py::arg("x"), py::arg("count"), py::arg("dtype"), py::arg("alpha"), nogil(),
      "x[i] *= alpha (floating dtypes).");
  m.def(
      "axpy",
      [](uintptr_t y, uintptr_t x, size_t count, int dtype, double alpha) {
        mlf::axpy(ptr(y), ptr(x), count, checked_floating(dtype, "axpy"), alpha);
      },
      py::arg("y"), py::arg("x"), py::arg("count"), py::arg("dtype"), py::arg("alpha"), nogil(),
      "y[i] += alpha * x[i] (floating dtypes).");
  m.def(
      "norm2",
      [](uintptr_t x, size_t count, int dtype) {
        return mlf::norm2(ptr(x), count, checked_dtype(dtype));
      },
      py::arg("x"), py::arg("count"), py::arg("dtype"), nogil(),
      "sqrt(sum x[i]^2), accumulated in float64.");
  m.def(
      "copy",
      [](uintptr_t dst, uintptr_t src, size_t nbytes) { mlf::copy(ptr(dst), ptr(src), nbytes); },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), nogil(),
      "memcpy (streaming stores for large copies); dst and src must not overlap.");
  // gather / scatter take their addresses and lengths as uint64 arrays (the grouped calls': no
  // conversion of 100 Python ints each) or as lists.
  using U64 = py::array_t<uint64_t, py::array::c_style>;
  m.def(
      "gather",
      [](uintptr_t dst, const U64& srcs, const U64& nbytes) {
        if (srcs.size() != nbytes.size())
          throw py::value_error("gather: srcs and nbytes differ in length");
        char* d = static_cast<char*>(ptr(dst));
        const uint64_t *s = srcs.data(), *b = nbytes.data();
        for (py::ssize_t i = 0; i < srcs.size(); d += b[i], ++i) mlf::copy(d, ptr(s[i]), b[i]);
      },
      py::arg("dst"), py::arg("srcs").noconvert(), py::arg("nbytes").noconvert(), nogil());
  m.def(
      "scatter",
      [](uintptr_t src, const U64& dsts, const U64& nbytes) {
        if (dsts.size() != nbytes.size())
          throw py::value_error("scatter: dsts and nbytes differ in length");
        const char* s = static_cast<const char*>(ptr(src));
        const uint64_t *d = dsts.data(), *b = nbytes.data();
        for (py::ssize_t i = 0; i < dsts.size(); s += b[i], ++i) mlf::copy(ptr(d[i]), s, b[i]);
      },
      py::arg("src"), py::arg("dsts").noconvert(), py::arg("nbytes").noconvert(), nogil());
  m.def(
      "copy_pieces",
      [](const U64& dsts, const U64& srcs, const U64& nbytes) {
        if (dsts.size() != srcs.size() || srcs.size() != nbytes.size())
          throw py::value_error("copy_pieces: dsts, srcs and nbytes differ in length");
        const uint64_t *d = dsts.data(), *s = srcs.data(), *b = nbytes.data();
        for (py::ssize_t i = 0; i < srcs.size(); ++i) mlf::copy(ptr(d[i]), ptr(s[i]), b[i]);
      },
      py::arg("dsts").noconvert(), py::arg("srcs").noconvert(), py::arg("nbytes").noconvert(),
      nogil(),
      "Copy srcs[i] to dsts[i] (nbytes[i] bytes each; uint64 arrays): a grouped allgather's "
      "pieces, from rank-major to each output's, in one call.");
  m.def(
      "gather",
      [](uintptr_t dst, const std::vector<uintptr_t>& srcs, const std::vector<size_t>& nbytes) {
        if (srcs.size() != nbytes.size())
          throw py::value_error("gather: srcs and nbytes differ in length");
        char* d = static_cast<char*>(ptr(dst));
        for (size_t i = 0; i < srcs.size(); d += nbytes[i], ++i) mlf::copy(d, ptr(srcs[i]), nbytes[i]);
      },
      py::arg("dst"), py::arg("srcs"), py::arg("nbytes"), nogil(),
      "Copy buffers srcs[i] (nbytes[i] bytes each) back to back into dst: one call for the many "
      "small tensors of a fused allreduce.");
  m.def(
      "scatter",
      [](uintptr_t src, const std::vector<uintptr_t>& dsts, const std::vector<size_t>& nbytes) {
        if (dsts.size() != nbytes.size())
          throw py::value_error("scatter: dsts and nbytes differ in length");
        const char* s = static_cast<const char*>(ptr(src));
        for (size_t i = 0; i < dsts.size(); s += nbytes[i], ++i) mlf::copy(ptr(dsts[i]), s, nbytes[i]);
      },
      py::arg("src"), py::arg("dsts"), py::arg("nbytes"), nogil(),
      "The inverse of gather: consecutive pieces of src (nbytes[i] bytes each) into dsts[i].");
  m.def("isa", []() { return std::string(mlf::isa()); },
        "Instruction set the CPU kernels use: 'scalar', 'avx2' or 'avx512'.");
  m.def("set_isa", [](const std::string& name) { return mlf::set_isa(name.c_str()); },
        py::arg("name"), "Force an instruction set; False (and no change) if unknown/unsupported.");
  m.def("cuda_built", []() {
#ifdef MLFABRIC_WITH_CUDA
    return true;
#else
    return false;
#endif
  }, "True if this build has the CUDA kernels (cuda_* functions).");

#ifdef MLFABRIC_WITH_CUDA
  m.def(
      "cuda_reduce",
      [](uintptr_t dst, const std::vector<uintptr_t>& srcs, size_t count, int dtype, int op,
         double scale, uintptr_t stream) {
        DType t = checked_dtype(dtype);
        RedOp o = checked_op(op);
        auto p = checked_srcs(srcs, t, scale);
        cuda_check(
            cuda::reduce(ptr(dst), p.data(), int(p.size()), count, t, o, scale, ptr(stream)));
      },
      py::arg("dst"), py::arg("srcs"), py::arg("count"), py::arg("dtype"), py::arg("op"),
      py::arg("scale") = 1.0, py::arg("stream") = 0, nogil(),
      "reduce() on device pointers, queued on `stream` (a cudaStream_t; 0 = default stream).");
  m.def(
      "cuda_scale",
      [](uintptr_t x, size_t count, int dtype, double alpha, uintptr_t stream) {
        DType t = checked_floating(dtype, "scale");
        cuda_check(cuda::scale(ptr(x), count, t, alpha, ptr(stream)));
      },
      py::arg("x"), py::arg("count"), py::arg("dtype"), py::arg("alpha"), py::arg("stream") = 0,
      nogil(), "scale() on a device pointer, queued on `stream`.");
  m.def(
      "cuda_axpy",
      [](uintptr_t y, uintptr_t x, size_t count, int dtype, double alpha, uintptr_t stream) {
        cuda_check(cuda::axpy(ptr(y), ptr(x), count, checked_floating(dtype, "axpy"), alpha,
                              ptr(stream)));
      },
      py::arg("y"), py::arg("x"), py::arg("count"), py::arg("dtype"), py::arg("alpha"),
      py::arg("stream") = 0, nogil(), "axpy() on device pointers, queued on `stream`.");
  m.def(
      "cuda_norm2",
      [](uintptr_t x, size_t count, int dtype, uintptr_t stream) {
        double out = 0.0;
        cuda_check(cuda::norm2(ptr(x), count, checked_dtype(dtype), ptr(stream), &out));
        return out;
      },
      py::arg("x"), py::arg("count"), py::arg("dtype"), py::arg("stream") = 0, nogil(),
      "norm2() of a device buffer; waits for `stream`.");
  m.def("cuda_device_count", []() { return cuda::device_count(); }, nogil(),
        "Visible CUDA devices; 0 without a driver or GPU.");
#endif
}

}  // namespace mlf
