// exit_watchdog.cc — a native timer that ends this process if it is still alive some seconds
// later (mlfabric/_core/exit_guard.py arms it at interpreter exit once a peer has died). Native
// because it must fire while the interpreter finalizes: MPI_Finalize runs from Py_AtExit, after
// every Python thread has stopped for good.
#include <pybind11/pybind11.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

namespace mlf {

void bind_exit_watchdog(pybind11::module_& m) {
  m.def(
      "arm_exit_watchdog",
      [](double seconds, int status, std::string message) {
        std::thread([seconds, status, message] {
          std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
          // write(2) and _exit: async-signal-safe, no locks another thread may hold
          ssize_t written = ::write(2, message.data(), message.size());
          (void)written;
          ::_exit(status);
        }).detach();  // a process that exits first ends it with itself
      },
      pybind11::arg("seconds"), pybind11::arg("status"), pybind11::arg("message"),
      "After `seconds`, write `message` to stderr and _exit(status) unless the process has "
      "exited by then. Cannot be disarmed.");
}

}  // namespace mlf
