// The harness's kernel-call loop: a step's calls of the kernels under test made from C++.
//
// The fast engine calls each case's kernel once per step through the op its project registered
// (worker/engine/kernel_ops.py binds the bundled ones). From Python each call parses its dozen
// arguments against the op's schema before the dispatcher runs; for a battery of ~87,000 calls
// that parsing was most of the kernel phase on the H200 (docs/PERFORMANCE.md, round 8). Here each
// case's arguments are converted and checked against the schema once (`add`), and `run(step)` makes
// every case's call in order through the same dispatcher entry (OperatorHandle::callBoxed: the
// same dispatch keys, the same kernel, the same arguments, the step number put in its place).
// Nothing is batched: one call per case and step, on the case's own tensors, in the order Python
// made them. A call that throws is reported with its index and never made again (the engine
// re-runs that case alone, as for a Python call that raised).
//
// Side streams (`run(step, side_streams)`): the step's calls are dealt in contiguous shares over
// the calling thread and one thread per side stream, each launching its share on its own stream.
// The kernels under test are called exactly as before (one call per case, its own tensors and
// arguments), only several at once: on the H200 a case's call costs the host more than the GPU
// spends on its kernel, so one thread leaves the GPU waiting (docs/PERFORMANCE.md, round 10). The
// engine asks for this only where every family of the wave declares `concurrent_steps`. Ordering is
// kept by events: every side stream waits for what the calling thread's stream had queued (the
// step's gradients), and that stream waits for every side stream before anything after the calls
// (the step's observation). Each side thread runs with the calling thread's thread-local state
// (grad mode, dispatch keys), as torch's own worker threads do.
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <exception>
#include <string>
#include <thread>
#include <tuple>
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

  // A side stream as torch packs it: (stream_id, device_index, device_type).
  using PackedStream = std::tuple<int64_t, int64_t, int64_t>;
  using Failures = std::vector<std::pair<int64_t, std::string>>;

  // Every live call whose case runs at `step`; the calls that threw, as (index, message), in
  // index order. With side streams the calls are shared out as the file's header says.
  Failures run(int64_t step, const std::vector<PackedStream>& side_streams) {
    std::vector<size_t> due;
    due.reserve(calls_.size());
    for (size_t i = 0; i < calls_.size(); ++i)
      if (calls_[i].live && step <= calls_[i].last_step) due.push_back(i);
    py::gil_scoped_release no_gil;  // the kernels never need Python
    const size_t shares = side_streams.size() + 1;
    if (shares == 1 || due.size() < 2 * shares) {
      Failures failed;
      call_share(due, 0, due.size(), step, failed);
      return failed;
    }
    std::vector<c10::Stream> streams;
    for (const auto& [id, index, type] : side_streams)
      streams.push_back(c10::Stream::unpack3(id, static_cast<c10::DeviceIndex>(index),
                                             static_cast<c10::DeviceType>(type)));
    const c10::Device device = streams.front().device();
    // On the CPU a call runs while it is made: the threads alone share the work, and there is
    // nothing to order (CPU "streams" have no events).
    const bool ordered = device.type() != c10::DeviceType::CPU;
    const c10::Stream current =
        ordered ? c10::impl::VirtualGuardImpl(device.type()).getStream(device) : streams.front();
    c10::Event queued(device.type());
    if (ordered) queued.record(current);  // what the side streams wait for: this step's inputs
    std::vector<c10::Event> finished;
    finished.reserve(streams.size());
    for (size_t k = 0; k < streams.size(); ++k) finished.emplace_back(device.type());
    std::vector<Failures> failed(shares);
    std::vector<std::exception_ptr> errors(shares);
    const at::ThreadLocalState caller_state;
    auto bound = [&](size_t share) { return due.size() * share / shares; };
    std::vector<std::thread> threads;
    threads.reserve(streams.size());
    for (size_t k = 1; k < shares; ++k) {
      threads.emplace_back([&, k] {
        try {
          at::ThreadLocalStateGuard state_guard(caller_state);
          const c10::Stream& stream = streams[k - 1];
          if (!ordered) {
            call_share(due, bound(k), bound(k + 1), step, failed[k]);
            return;
          }
          queued.block(stream);
          c10::StreamGuard stream_guard(stream);
          call_share(due, bound(k), bound(k + 1), step, failed[k]);
          finished[k - 1].record(stream);
        } catch (...) {
          errors[k] = std::current_exception();
        }
      });
    }
    try {
      call_share(due, 0, bound(1), step, failed[0]);
    } catch (...) {
      errors[0] = std::current_exception();
    }
    for (auto& thread : threads) thread.join();
    // An event a failed thread never recorded is not waited for (c10::Event::block).
    if (ordered)
      for (size_t k = 0; k < streams.size(); ++k) finished[k].block(current);
    for (const auto& error : errors)
      if (error) std::rethrow_exception(error);
    Failures merged;  // shares are contiguous and in order, so this keeps index order
    for (auto& share : failed) merged.insert(merged.end(), share.begin(), share.end());
    return merged;
  }

  // The engine gave up on call `index` (its case broke elsewhere): never make it again.
  void drop(int64_t index) { calls_.at(static_cast<size_t>(index)).live = false; }

  int64_t size() const { return static_cast<int64_t>(calls_.size()); }

 private:
  // The calls due[first..last) of `step`, in order; each that throws is dropped and reported.
  void call_share(const std::vector<size_t>& due, size_t first, size_t last, int64_t step, Failures& failed) {
    for (size_t position = first; position < last; ++position) {
      Call& call = calls_[due[position]];
      std::vector<c10::IValue> stack(call.arguments);
      if (call.step_at >= 0) stack[call.step_at] = c10::IValue(step);
      try {
        call.op.callBoxed(stack);
      } catch (const c10::Error& error) {
        call.live = false;
        failed.emplace_back(static_cast<int64_t>(due[position]), error.what_without_backtrace());
      } catch (const std::exception& error) {
        call.live = false;
        failed.emplace_back(static_cast<int64_t>(due[position]), error.what());
      }
    }
  }

  struct Call {
    c10::OperatorHandle op;
    std::vector<c10::IValue> arguments;
    int64_t step_at;
    int64_t last_step;
    bool live;
  };
  std::vector<Call> calls_;
};

}  // namespace
}  // namespace optdrift_harness

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "optdrift's harness: the kernel-call loop (the od2 observation registers as a torch op)";
  py::class_<optdrift_harness::PreparedCalls>(m, "PreparedCalls")
      .def(py::init<>())
      .def("add", &optdrift_harness::PreparedCalls::add, py::arg("name"), py::arg("overload"),
           py::arg("arguments"), py::arg("step_at"), py::arg("last_step"))
      .def("run", &optdrift_harness::PreparedCalls::run, py::arg("step"),
           py::arg("side_streams") = std::vector<optdrift_harness::PreparedCalls::PackedStream>{})
      .def("drop", &optdrift_harness::PreparedCalls::drop, py::arg("index"))
      .def("__len__", &optdrift_harness::PreparedCalls::size);
}
