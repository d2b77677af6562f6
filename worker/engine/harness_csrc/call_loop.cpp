// The harness's kernel-call loop: a step's calls of the kernels under test made from C++.
//
// The fast engine calls each case's kernel once per step through the op its project registered
// (worker/engine/kernel_ops.py binds the bundled ones). From Python each call parses its dozen
// arguments against the op's schema before the dispatcher runs; for a battery of ~87,000 calls
// that parsing costs the host more than the dispatch and the launch together. Here each
// case's arguments are converted and checked against the schema once (`add`), and `run(step)` makes
// every case's call in order through the same dispatcher entry (OperatorHandle::callBoxed: the
// same dispatch keys, the same kernel, the same arguments, the step number put in its place).
// Nothing is batched: one call per case and step, on the case's own tensors, in the order Python
// made them. A call that throws is reported with its index and never made again (the engine
// re-runs that case alone, as for a Python call that raised).
//
// Below the autograd layer: a call from Python enters the dispatcher at its autograd key, where
// an op with no autograd kernel (every bundled op) meets torch's boxed autograd fallback, which
// walks the arguments for tensors that require grad and bumps the version counters of the
// mutated ones before it redispatches to the backend kernel. Nothing here needs gradients or
// version counters, so by default the loop enters below that layer
// (at::AutoDispatchBelowADInplaceOrView, as torch's own fallbacks do before they redispatch):
// the same backend kernel with the same arguments, without the walk.
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>

#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace optdrift_harness {
namespace {

// One Python argument as the IValue the schema's argument `expected` takes, or an error naming it.
c10::IValue to_ivalue(const py::handle& value, const c10::Argument& expected, const std::string& op) {
  const auto kind = expected.type()->kind();
  PyObject* object = value.ptr();
  if (kind == c10::TypeKind::TensorType && THPVariable_Check(object)) return THPVariable_Unpack(object);
  if (kind == c10::TypeKind::BoolType && PyBool_Check(object)) return c10::IValue(object == Py_True);
  if (kind == c10::TypeKind::IntType && PyLong_Check(object) && !PyBool_Check(object))
    return c10::IValue(value.cast<int64_t>());
  if (kind == c10::TypeKind::FloatType && (PyFloat_Check(object) || (PyLong_Check(object) && !PyBool_Check(object))))
    return c10::IValue(value.cast<double>());
  throw std::invalid_argument(op + ": argument '" + expected.name() + "' (" + expected.type()->str() +
                              ") cannot be prepared from a Python " + Py_TYPE(object)->tp_name);
}

class PreparedCalls {
 public:
  // `below_autograd`: make the calls below the autograd layer (see the top of this file).
  explicit PreparedCalls(bool below_autograd = true) : below_autograd_(below_autograd) {}

  // One case's call: op `name` ("namespace::op") and `overload` ("" for the default), every
  // argument in schema order; `step_at` is the index of the step number (-1: none); the call is
  // made for steps 1..last_step. Returns its index.
  int64_t add(const std::string& name, const std::string& overload, const py::sequence& arguments,
              int64_t step_at, int64_t last_step) {
    const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), overload.c_str());
    const auto& schema = handle.schema();
    const auto& expected = schema.arguments();
    if (static_cast<size_t>(py::len(arguments)) != expected.size())
      throw std::invalid_argument(name + " takes " + std::to_string(expected.size()) + " arguments, " +
                                  std::to_string(py::len(arguments)) + " were given");
    std::vector<c10::IValue> stack;
    stack.reserve(expected.size());
    for (size_t i = 0; i < expected.size(); ++i) stack.push_back(to_ivalue(arguments[i], expected[i], name));
    if (step_at >= 0 && (static_cast<size_t>(step_at) >= stack.size() || !stack[step_at].isInt()))
      throw std::invalid_argument(name + ": the step number's place " + std::to_string(step_at) +
                                  " is not an int argument");
    calls_.push_back(Call{handle, std::move(stack), step_at, last_step, true});
    return static_cast<int64_t>(calls_.size()) - 1;
  }

  // Every live call whose case runs at `step`, in order; the calls that threw, as (index, message).
  std::vector<std::pair<int64_t, std::string>> run(int64_t step) {
    std::vector<std::pair<int64_t, std::string>> failed;
    py::gil_scoped_release no_gil;  // the kernels never need Python
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    if (below_autograd_) below.emplace();
    for (size_t i = 0; i < calls_.size(); ++i) {
      Call& call = calls_[i];
      if (!call.live || step > call.last_step) continue;
      std::vector<c10::IValue> stack(call.arguments);
      if (call.step_at >= 0) stack[call.step_at] = c10::IValue(step);
      try {
        call.op.callBoxed(stack);
      } catch (const c10::Error& error) {
        call.live = false;
        failed.emplace_back(static_cast<int64_t>(i), error.what_without_backtrace());
      } catch (const std::exception& error) {
        call.live = false;
        failed.emplace_back(static_cast<int64_t>(i), error.what());
      }
    }
    return failed;
  }

  // The engine gave up on call `index` (its case broke elsewhere): never make it again.
  void drop(int64_t index) { calls_.at(static_cast<size_t>(index)).live = false; }

  int64_t size() const { return static_cast<int64_t>(calls_.size()); }

 private:
  struct Call {
    c10::OperatorHandle op;
    std::vector<c10::IValue> arguments;
    int64_t step_at;
    int64_t last_step;
    bool live;
  };
  std::vector<Call> calls_;
  bool below_autograd_;
};

}  // namespace
}  // namespace optdrift_harness

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "optdrift's harness: the kernel-call loop (the od2 observation registers as a torch op)";
  py::class_<optdrift_harness::PreparedCalls>(m, "PreparedCalls")
      .def(py::init<bool>(), py::arg("below_autograd") = true)
      .def("add", &optdrift_harness::PreparedCalls::add, py::arg("name"), py::arg("overload"),
           py::arg("arguments"), py::arg("step_at"), py::arg("last_step"))
      .def("run", &optdrift_harness::PreparedCalls::run, py::arg("step"))
      .def("drop", &optdrift_harness::PreparedCalls::drop, py::arg("index"))
      .def("__len__", &optdrift_harness::PreparedCalls::size);
}
