// shm_engine.h — the intra-host collective engine: ranks on one host exchange data through one
// shared-memory segment (an MPI-3 shared window opened in Python) and reduce it with mlfabric's own
// kernels, instead of MPI point-to-point copies.
//
// Owns: the segment layout, the round protocol (three sequence flags per rank), the header check
// that turns mismatched calls into errors on every rank, and the pipelined/zero-copy data paths.
// Never calls MPI or Python; every wait is bounded by a timeout so a dead peer is an error, not a
// hang. One engine per process and communicator; calls are serialized by the caller.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels.h"

namespace mlf {

enum class Kind : int64_t { barrier = 0, allreduce = 1, reduce = 2, reduce_scatter = 3,
                            allgather = 4, broadcast = 5 };

// A call's header: int64 words written by every rank. Words [0, kHdrCheck) must be equal on all
// ranks (kind, dtype, op, root, count, ndim, dims...); words [kHdrCheck, kHdrWords) describe the
// zero-copy candidacy (shared-buffer id and offset of input and output, -1 when not shared).
constexpr int kHdrWords = 16;
constexpr int kHdrCheck = 12;

struct CallArgs {
  Kind kind = Kind::barrier;
  DType dtype = DType::f32;
  RedOp op = RedOp::sum;
  double scale = 1.0;
  int root = 0;
  const char* in = nullptr;   // allreduce/reduce/reduce_scatter: count elements; allgather: count
  char* out = nullptr;        // per rank; broadcast: `out` is the buffer (in unused)
  size_t count = 0;
  std::vector<size_t> chunks;          // elements per rank's chunk (reduce_scatter); else empty
  std::vector<int64_t> header;         // kHdrWords words
  std::vector<uintptr_t> peer_in;      // peers' input addresses when my input is a shared buffer
  std::vector<uintptr_t> peer_out;     // peers' output addresses when my output is a shared buffer
};

// status: 0 ok, 1 mismatch (headers() has every rank's header as seen), 2 timeout, 3 another
// failure (a single-copy read refused); after 2 or 3 the engine is unusable.
struct CallResult {
  int status = 0;
  bool zero_copy = false;
  std::string message;
};

class ShmEngine {
 public:
  ShmEngine(uintptr_t base, size_t bytes, int rank, int nranks, size_t block_bytes, int slots,
            double timeout_s);
  static size_t required_bytes(int nranks, size_t block_bytes, int slots);
  void reset_segment();   // local rank 0 only, before everyone's first call (then a barrier)
  CallResult run(const CallArgs& a);
  const std::vector<int64_t>& headers() const { return snapshot_; }  // nranks * kHdrWords
  bool broken() const { return broken_; }
  bool any_failed() const;  // some rank's engine gave up (timeout or failure): peers may be gone
  // Give up without a failed call of the engine's own (the caller's call failed elsewhere, e.g.
  // in an MPI algorithm after the engine's header round): peers waiting here fail at once, as
  // after a timeout (status 2) or another failure (3). A mark already there stays.
  void abandon(int status);

  // Single-copy path (Linux cross-memory attach, process_vm_readv): ranks read their peers'
  // private buffers directly, as MPI's shared-memory transport does. probe_publish() and
  // probe_peers() test once whether the kernel allows it here; the caller agrees on the answer
  // across ranks and passes it to enable_cma(). Used for allreduce calls of more than one step,
  // of more than min_bytes and at most max_bytes; others keep the staged path.
  void probe_publish();
  bool probe_peers();
  void enable_cma(bool on, size_t min_bytes, size_t max_bytes) {
    cma_ = on;
    cma_min_bytes_ = min_bytes;
    cma_max_bytes_ = max_bytes;
  }
  bool cma_enabled() const { return cma_; }
  uint64_t cma_calls() const { return cma_calls_; }  // calls that took the single-copy path

  // Prepared calls: the fixed part of a call repeated many times (kind, dtype, op, scale,
  // header), so the hot path passes only the buffers. Returns the plan's index.
  int add_plan(CallArgs a) {
    plans_.push_back(std::move(a));
    return static_cast<int>(plans_.size()) - 1;
  }
  CallArgs& plan(size_t i) { return plans_.at(i); }
  std::string last_message;  // of the last run_plan() that failed (set by the binding)

 private:
  enum Field { kIn = 0, kRed = 1, kOut = 2 };
  std::atomic<uint64_t>& flag(int r, Field f) const;
  int64_t* header_slot(int r, uint64_t round) const;
  char* slot(uint64_t round, int r) const;
  void publish(Field f, uint64_t round);
  void wait_all(Field f, uint64_t target, const char* what, int only = -1);
  bool check_headers(uint64_t round, CallResult& res);

  void staged(const CallArgs& a, bool combined);
  void zero_copy(const CallArgs& a);
  void cma_allreduce(const CallArgs& a);
  void read_peer(int j, void* local, uintptr_t remote, size_t bytes);
  void sync_round(const char* what);
  void close_round(uint64_t k);
  std::atomic<uint64_t>& failed(int r) const;
  struct Extras;
  Extras& extras(int r) const;
  void stage_step(const CallArgs& a, uint64_t k, size_t step, size_t e);
  void compute_step(const CallArgs& a, uint64_t k, size_t step, size_t e);
  void drain_step(const CallArgs& a, uint64_t k, size_t step, size_t e);
  size_t sub_elems(const CallArgs& a) const;
  size_t num_steps(const CallArgs& a, size_t e) const;

  char* base_;
  int rank_, n_;
  size_t slot_bytes_;
  int slots_;
  double timeout_s_;
  char* ctl_;
  char* data_;
  uint64_t round_ = 0;     // rounds this rank has started; the same on every rank between calls
  bool broken_ = false;
  bool redundant_ = false;  // this call: small allreduce reduced whole by every rank
  std::vector<int64_t> snapshot_;
  std::vector<size_t> chunk_off_, chunk_len_;  // scratch: this call's partition
  std::vector<const void*> srcs_;
  std::vector<CallArgs> plans_;
  bool cma_ = false;
  size_t cma_min_bytes_ = 0, cma_max_bytes_ = 0;
  uint64_t cma_calls_ = 0;
  std::vector<char> cma_tmp_;              // scratch: one source pointer per rank
};

}  // namespace mlf
