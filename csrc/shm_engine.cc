// shm_engine.cc — see shm_engine.h. The protocol, in one place:
//
// Every rank runs the same sequence of rounds; round k uses data slot k % slots. Each rank owns
// three monotonic flags — in (my input for round k is staged / my header is written), red (my
// reduction for round k is done), out (I have finished reading round k's slots) — and waits on
// its peers' flags with acquire loads. A slot is reused only once every rank's out flag has
// passed the round that last used it, so nobody overwrites data a peer still reads.
//
// The first round of every call carries each rank's header; after everyone's in flag arrives,
// every rank compares all headers, so a mismatch is seen by all ranks in the same round and they
// all return status 1 without touching the data. Headers are double-buffered by round parity,
// and a rank writes its header for round k only once every rank has published out for round
// k-2, the last round that used the same slot (rounds of broadcast data wait only for the root,
// so nothing else would stop a root from running two rounds ahead of a slow reader).
//
// Data paths:
//  - staged: a call larger than one step is cut into steps; per step each rank copies into its
//    slot the blocks of its input that its peers reduce (copy-in), reduces its own sub-block
//    across its own input and the peers' slots (so the reduce-scatter is spread over all ranks),
//    and copies every reduced block out. Blocks are small enough to stay in cache, so DRAM sees
//    the input once and the output once.
//  - combined: a call of one step carries its data in the header round (one round trip in all —
//    this is what keeps small-message latency low).
//  - zero-copy: when every rank's buffer lives in an mlfabric shared buffer at the same offset,
//    ranks read their peers' buffers directly; no staging at all.
#include "shm_engine.h"

#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>

namespace mlf {
namespace {

constexpr size_t kLine = 64;
constexpr size_t kCtlBytes = 512;         // per rank: 3 flag lines, 2 headers of 16 words, extras
constexpr size_t kHeaderOffset = 3 * kLine;
constexpr size_t kExtrasOffset = kHeaderOffset + 2 * kHdrWords * sizeof(int64_t);
constexpr size_t kFailedOffset = kExtrasOffset + 4 * sizeof(int64_t);  // nonzero: rank gave up
constexpr size_t kCmaTile = 1 << 20;      // bytes read from each peer per reduction tile:
                                          // few system calls, still cache-resident
const uint64_t kProbeWord = 0x6d6c6661627269ULL;  // read by peers to test process_vm_readv
constexpr size_t kZeroCopyTile = 32768;   // bytes per tile: the reduced tile is re-read from L1/L2
// An allreduce up to this size is reduced whole by every rank (same sources, same order, so the
// same bits everywhere): one synchronisation instead of two, which is what small calls pay for.
constexpr size_t kRedundantBytes = 16384;

struct EngineFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Timeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

size_t slot_bytes_for(int n, size_t block) {
  // Each rank's sub-block holds at least 16 elements of the widest dtype.
  return round_up(std::max(block, static_cast<size_t>(n) * 16 * 8), kLine);
}

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::barrier: return "barrier";
    case Kind::allreduce: return "allreduce";
    case Kind::reduce: return "reduce";
    case Kind::reduce_scatter: return "reduce_scatter";
    case Kind::allgather: return "allgather";
    case Kind::broadcast: return "broadcast";
  }
  return "?";
}

}  // namespace

// What a rank tells its peers about the call in flight, beside its header: where its buffers are
// in its own address space, for the single-copy path.
struct ShmEngine::Extras {
  int64_t pid;
  uint64_t in, out, probe;
};
static_assert(kFailedOffset + sizeof(uint64_t) <= kCtlBytes, "ctl block too small");

std::atomic<uint64_t>& ShmEngine::failed(int r) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(ctl_ + kCtlBytes * r + kFailedOffset);
}

ShmEngine::Extras& ShmEngine::extras(int r) const {
  return *reinterpret_cast<Extras*>(ctl_ + kCtlBytes * r + kExtrasOffset);
}

bool ShmEngine::any_failed() const {
  for (int r = 0; r < n_; ++r)
    if (failed(r).load(std::memory_order_acquire)) return true;
  return false;
}

void ShmEngine::abandon(int status) {
  broken_ = true;
  uint64_t none = 0;
  failed(rank_).compare_exchange_strong(none, static_cast<uint64_t>(status == 2 ? 2 : 3),
                                        std::memory_order_acq_rel);
}

void ShmEngine::probe_publish() {
  extras(rank_).pid = getpid();
  extras(rank_).probe = reinterpret_cast<uintptr_t>(&kProbeWord);
}

// process_vm_readv (cross-memory attach) exists on Linux only; elsewhere the probe fails, the ranks
// agree the single-copy path is off, and every call takes the staged path.
bool ShmEngine::probe_peers() {
#ifndef __linux__
  return false;
#else
  for (int j = 0; j < n_; ++j) {
    if (j == rank_) continue;
    uint64_t word = 0;
    iovec local{&word, sizeof word}, remote{reinterpret_cast<void*>(extras(j).probe), sizeof word};
    if (process_vm_readv(static_cast<pid_t>(extras(j).pid), &local, 1, &remote, 1, 0) !=
            static_cast<ssize_t>(sizeof word) || word != kProbeWord)
      return false;
  }
  return true;
#endif
}

void ShmEngine::read_peer(int j, void* local, uintptr_t remote, size_t bytes) {
#ifndef __linux__
  (void)local, (void)remote, (void)bytes;
  std::ostringstream os;
  os << "reading local rank " << j << "'s buffer: no single-copy path on this platform";
  throw EngineFailure(os.str());
#else
  char* dst = static_cast<char*>(local);
  while (bytes > 0) {
    iovec l{dst, bytes}, r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t got = process_vm_readv(static_cast<pid_t>(extras(j).pid), &l, 1, &r, 1, 0);
    if (got <= 0) {
      std::ostringstream os;
      os << "reading local rank " << j << "'s buffer failed (process_vm_readv: "
         << std::strerror(errno) << ")";
      throw EngineFailure(os.str());
    }
    dst += got, remote += static_cast<size_t>(got), bytes -= static_cast<size_t>(got);
  }
#endif
}

void ShmEngine::sync_round(const char* what) {
  const uint64_t k = ++round_;
  publish(kIn, k);
  wait_all(kIn, k, what);
  close_round(k);
}

void ShmEngine::close_round(uint64_t k) {
  publish(kRed, k);
  publish(kOut, k);
}

void ShmEngine::cma_allreduce(const CallArgs& a) {
  const size_t isz = dtype_size(a.dtype);
  const size_t off = chunk_off_[rank_], len = chunk_len_[rank_];
  // Per-peer tiles of up to kCmaTile, fewer bytes with many ranks (at most ~16 MiB in all).
  const size_t tile_bytes = std::max<size_t>(kLine, std::min(kCmaTile, (size_t(16) << 20) / n_) /
                                                        kLine * kLine);
  const size_t tile = tile_bytes / isz;
  cma_tmp_.resize(static_cast<size_t>(n_) * tile_bytes);
  // Reduce-scatter: my chunk, tile by tile, from my input and each peer's input (read into a
  // private tile that stays in cache), into my output.
  for (size_t t = 0; t < len; t += tile) {
    const size_t l = std::min(tile, len - t), at = (off + t) * isz;
    for (int j = 0; j < n_; ++j) {
      if (j == rank_) {
        srcs_[j] = a.in + at;
        continue;
      }
      char* tmp = cma_tmp_.data() + static_cast<size_t>(j) * tile_bytes;
      read_peer(j, tmp, extras(j).in + at, l * isz);
      srcs_[j] = tmp;
    }
    reduce(a.out + at, srcs_.data(), n_, l, a.dtype, a.op, a.scale);
  }
  sync_round("allreduce");  // every chunk is reduced; nobody has overwritten an input chunk
  // Allgather: every peer's reduced chunk straight from its output into mine.
  for (int j = 0; j < n_; ++j)
    if (j != rank_ && chunk_len_[j])
      read_peer(j, a.out + chunk_off_[j] * isz, extras(j).out + chunk_off_[j] * isz,
                chunk_len_[j] * isz);
  sync_round("allreduce");  // nobody reuses its output before every peer has read it
}

size_t ShmEngine::required_bytes(int nranks, size_t block_bytes, int slots) {
  return kCtlBytes * nranks + slot_bytes_for(nranks, block_bytes) * nranks * slots + kLine;
}

ShmEngine::ShmEngine(uintptr_t base, size_t bytes, int rank, int nranks, size_t block_bytes,
                     int slots, double timeout_s)
    : rank_(rank), n_(nranks), slot_bytes_(slot_bytes_for(nranks, block_bytes)),
      slots_(slots), timeout_s_(timeout_s) {
  if (nranks < 1 || rank < 0 || rank >= nranks || slots < 2)
    throw std::invalid_argument("ShmEngine: bad rank/size/slots");
  if (bytes < required_bytes(nranks, block_bytes, slots))
    throw std::invalid_argument("ShmEngine: segment too small");
  base_ = reinterpret_cast<char*>(round_up(base, kLine));
  srcs_.resize(n_);
  ctl_ = base_;
  data_ = ctl_ + kCtlBytes * n_;
}

void ShmEngine::reset_segment() { std::memset(ctl_, 0, kCtlBytes * n_); }

std::atomic<uint64_t>& ShmEngine::flag(int r, Field f) const {
  return *reinterpret_cast<std::atomic<uint64_t>*>(ctl_ + kCtlBytes * r + kLine * f);
}

int64_t* ShmEngine::header_slot(int r, uint64_t round) const {
  return reinterpret_cast<int64_t*>(ctl_ + kCtlBytes * r + kHeaderOffset +
                                    (round & 1) * kHdrWords * sizeof(int64_t));
}

char* ShmEngine::slot(uint64_t round, int r) const {
  return data_ + ((round % slots_) * n_ + r) * slot_bytes_;
}

void ShmEngine::publish(Field f, uint64_t round) {
  flag(rank_, f).store(round, std::memory_order_release);
}

void ShmEngine::wait_all(Field f, uint64_t target, const char* what, int only) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  uint64_t spins = 0;
  for (int j = 0; j < n_; ++j) {
    if (only >= 0 && j != only) continue;
    auto& a = flag(j, f);
    while (a.load(std::memory_order_acquire) < target) {
      // Spin briefly (a peer on another core answers within a microsecond), then yield: ranks
      // are often oversubscribed, and spinning would starve the peer we wait for.
      if (++spins < 256) {
        cpu_relax();
        continue;
      }
      sched_yield();
      if ((spins & 63) != 0) continue;
      // A peer that gave up (timed out: 2, failed: 3) says so: give up now, not at our timeout.
      int gave_up = -1;
      uint64_t why = 0;
      for (int m = 0; m < n_ && gave_up < 0; ++m)
        if ((why = failed(m).load(std::memory_order_acquire)) != 0) gave_up = m;
      const bool late = std::chrono::duration<double>(clock::now() - start).count() > timeout_s_;
      if (gave_up >= 0 && why != 2) {
        std::ostringstream os;
        os << "local rank " << gave_up << " failed during " << what << " (see its error)";
        throw EngineFailure(os.str());
      }
      if (late || gave_up >= 0) {
        std::ostringstream os;
        os << (late ? "timed out after " : "gave up (a peer timed out) after ")
           << std::chrono::duration<double>(clock::now() - start).count() << " s in " << what
           << " waiting for local rank(s)";
        for (int m = 0; m < n_; ++m)
          if ((only < 0 || m == only) && flag(m, f).load(std::memory_order_acquire) < target)
            os << ' ' << m;
        os << " (round " << target << "): a peer died, hung, or is in a different collective";
        throw Timeout(os.str());
      }
    }
  }
}

size_t ShmEngine::sub_elems(const CallArgs& a) const {
  const size_t isz = dtype_size(a.dtype);
  if (a.kind == Kind::allgather || a.kind == Kind::broadcast) return slot_bytes_ / isz;
  return std::max<size_t>(16, slot_bytes_ / (n_ * isz) / 16 * 16);
}

size_t ShmEngine::num_steps(const CallArgs& a, size_t e) const {
  size_t longest = 0;
  switch (a.kind) {
    case Kind::barrier: return 0;
    case Kind::allgather:
    case Kind::broadcast: longest = a.count; break;
    default:
      for (size_t len : chunk_len_) longest = std::max(longest, len);
  }
  return (longest + e - 1) / e;
}

void ShmEngine::stage_step(const CallArgs& a, uint64_t k, size_t s, size_t e) {
  if (k > static_cast<uint64_t>(slots_)) wait_all(kOut, k - slots_, kind_name(a.kind));
  const size_t isz = dtype_size(a.dtype);
  char* mine = slot(k, rank_);
  const size_t lo = s * e;
  if (redundant_) {
    copy(mine, a.in, a.count * isz);
    return;
  }
  switch (a.kind) {
    case Kind::allreduce:
    case Kind::reduce:
    case Kind::reduce_scatter:
      // Only the chunks my peers reduce: my own chunk is read from my input in place.
      for (int q = 0; q < n_; ++q) {
        if (q == rank_ || lo >= chunk_len_[q]) continue;
        const size_t l = std::min(e, chunk_len_[q] - lo);
        copy(mine + q * e * isz, a.in + (chunk_off_[q] + lo) * isz, l * isz);
      }
      break;
    case Kind::allgather:
      if (lo < a.count) copy(mine, a.in + lo * isz, std::min(e, a.count - lo) * isz);
      break;
    case Kind::broadcast:
      if (rank_ == a.root && lo < a.count)
        copy(mine, a.out + lo * isz, std::min(e, a.count - lo) * isz);
      break;
    case Kind::barrier: break;
  }
}

void ShmEngine::compute_step(const CallArgs& a, uint64_t k, size_t s, size_t e) {
  const bool reducing = a.kind == Kind::allreduce || a.kind == Kind::reduce ||
                        a.kind == Kind::reduce_scatter;
  const size_t lo = s * e;
  if (redundant_) {
    for (int j = 0; j < n_; ++j) srcs_[j] = slot(k, j);
    reduce(a.out, srcs_.data(), n_, a.count, a.dtype, a.op, a.scale);
  } else if (reducing && lo < chunk_len_[rank_]) {
    // Reduce my sub-block (chunk rank_) across my input and every peer's slot, into my own slot
    // (lines I already own; peers copy the result from there) or, for reduce_scatter, straight
    // into the output.
    const size_t isz = dtype_size(a.dtype);
    const size_t l = std::min(e, chunk_len_[rank_] - lo);
    for (int j = 0; j < n_; ++j) srcs_[j] = slot(k, j) + rank_ * e * isz;
    srcs_[rank_] = a.in + (chunk_off_[rank_] + lo) * isz;
    char* dst = a.kind == Kind::reduce_scatter ? a.out + lo * isz : slot(k, rank_) + rank_ * e * isz;
    reduce(dst, srcs_.data(), n_, l, a.dtype, a.op, a.scale);
  }
  publish(kRed, k);
}

void ShmEngine::drain_step(const CallArgs& a, uint64_t k, size_t s, size_t e) {
  const size_t isz = dtype_size(a.dtype);
  const size_t lo = s * e;
  switch (a.kind) {
    case Kind::allreduce:
    case Kind::reduce:
      if (redundant_) break;
      if (a.kind == Kind::allreduce || rank_ == a.root) {
        wait_all(kRed, k, kind_name(a.kind));
        for (int q = 0; q < n_; ++q) {
          if (lo >= chunk_len_[q]) continue;
          const size_t l = std::min(e, chunk_len_[q] - lo);
          copy(a.out + (chunk_off_[q] + lo) * isz, slot(k, q) + q * e * isz, l * isz);
        }
      }
      break;
    case Kind::allgather:
      if (lo < a.count) {
        const size_t l = std::min(e, a.count - lo);
        for (int j = 0; j < n_; ++j) copy(a.out + (j * a.count + lo) * isz, slot(k, j), l * isz);
      }
      break;
    case Kind::broadcast:
      if (rank_ != a.root && lo < a.count)
        copy(a.out + lo * isz, slot(k, a.root), std::min(e, a.count - lo) * isz);
      break;
    default: break;
  }
  publish(kOut, k);
}

bool ShmEngine::check_headers(uint64_t k, CallResult& res) {
  const int64_t* h0 = header_slot(0, k);
  bool same = true, zc_same = true;
  for (int j = 1; j < n_; ++j) {
    const int64_t* h = header_slot(j, k);
    same = same && std::equal(h0, h0 + kHdrCheck, h);
    zc_same = zc_same && std::equal(h0 + kHdrCheck, h0 + kHdrWords, h + kHdrCheck);
  }
  if (!same) {
    snapshot_.resize(static_cast<size_t>(n_) * kHdrWords);
    for (int j = 0; j < n_; ++j)
      std::copy(header_slot(j, k), header_slot(j, k) + kHdrWords, &snapshot_[j * kHdrWords]);
    res.status = 1;
    res.message = "mismatch";
    return false;
  }
  const Kind kind = static_cast<Kind>(h0[0]);
  const bool in_shared = h0[kHdrCheck] >= 0, out_shared = h0[kHdrCheck + 2] >= 0;
  res.zero_copy = zc_same && in_shared && (kind != Kind::allreduce || out_shared) &&
                  kind != Kind::reduce && kind != Kind::barrier;
  return true;
}

void ShmEngine::zero_copy(const CallArgs& a) {
  const size_t isz = dtype_size(a.dtype);
  switch (a.kind) {
    case Kind::allreduce:
    case Kind::reduce_scatter: {
      const size_t tile = kZeroCopyTile / isz;
      const size_t off = chunk_off_[rank_], len = chunk_len_[rank_];
      for (size_t t = 0; t < len; t += tile) {
        const size_t l = std::min(tile, len - t);
        for (int j = 0; j < n_; ++j)
          srcs_[j] = reinterpret_cast<const char*>(a.peer_in[j]) + (off + t) * isz;
        if (a.kind == Kind::reduce_scatter) {
          reduce(a.out + t * isz, srcs_.data(), n_, l, a.dtype, a.op, a.scale);
          continue;
        }
        char* mine = reinterpret_cast<char*>(a.peer_out[rank_]) + (off + t) * isz;
        reduce(mine, srcs_.data(), n_, l, a.dtype, a.op, a.scale);
        for (int j = 0; j < n_; ++j)
          if (j != rank_) copy(reinterpret_cast<char*>(a.peer_out[j]) + (off + t) * isz, mine, l * isz);
      }
      break;
    }
    case Kind::allgather:
      for (int j = 0; j < n_; ++j)
        copy(a.out + j * a.count * isz, reinterpret_cast<const char*>(a.peer_in[j]), a.count * isz);
      break;
    case Kind::broadcast:
      if (rank_ != a.root)
        copy(a.out, reinterpret_cast<const char*>(a.peer_in[a.root]), a.count * isz);
      break;
    default: break;
  }
  sync_round(kind_name(a.kind));  // nobody reuses its buffer before every peer is done with it
}

CallResult ShmEngine::run(const CallArgs& a) {
  CallResult res;
  if (broken_) {
    res.status = 2;
    res.message = "the shared-memory engine is unusable after an earlier timeout";
    return res;
  }
  if (a.header.size() != static_cast<size_t>(kHdrWords))
    throw std::invalid_argument("ShmEngine::run: header must have 16 words");
  // This call's partition into per-rank chunks (allreduce/reduce: near-equal element ranges).
  chunk_len_.assign(n_, 0);
  chunk_off_.assign(n_, 0);
  if (a.kind == Kind::reduce_scatter) {
    if (a.chunks.size() != static_cast<size_t>(n_))
      throw std::invalid_argument("ShmEngine::run: reduce_scatter needs one chunk count per rank");
    chunk_len_ = a.chunks;
  } else if (a.kind == Kind::allreduce || a.kind == Kind::reduce) {
    for (int q = 0; q < n_; ++q) chunk_len_[q] = a.count / n_ + (q < static_cast<int>(a.count % n_));
  }
  for (int q = 1; q < n_; ++q) chunk_off_[q] = chunk_off_[q - 1] + chunk_len_[q - 1];

  const size_t e = sub_elems(a);
  const size_t steps = num_steps(a, e);
  const bool combined = steps <= 1;
  redundant_ = combined && a.kind == Kind::allreduce &&
               a.count * dtype_size(a.dtype) <= std::min(kRedundantBytes, slot_bytes_);
  const char* what = kind_name(a.kind);
  try {
    // Header round (with the data of step 0 when the call is one step long).
    uint64_t k = ++round_;
    if (combined && steps == 1) stage_step(a, k, 0, e);
    // The header slot of parity k&1 was last read in round k-2: wait until every rank is past
    // it (a rank publishes out for a header round only after reading the headers).
    if (k > 2) wait_all(kOut, k - 2, what);
    std::copy(a.header.begin(), a.header.end(), header_slot(rank_, k));
    extras(rank_).in = reinterpret_cast<uintptr_t>(a.in);
    extras(rank_).out = reinterpret_cast<uintptr_t>(a.out);
    publish(kIn, k);
    wait_all(kIn, k, what);
    // A rank arriving after its peers gave up on this call finds their arrival marks already
    // there (published before they timed out): without this check it would pass the header
    // round alone (and a one-step call would "succeed" on it only).
    if (any_failed())
      throw Timeout("gave up: a peer already gave up on this or an earlier call (a peer died, "
                    "hung, or is in a different collective)");
    if (!check_headers(k, res)) {
      close_round(k);
      return res;
    }
    if (combined) {
      if (steps == 1) {
        compute_step(a, k, 0, e);
        drain_step(a, k, 0, e);
      } else {
        close_round(k);
      }
      res.zero_copy = false;
      return res;
    }
    close_round(k);
    if (res.zero_copy && !a.peer_in.empty() &&
        (a.kind != Kind::allreduce || !a.peer_out.empty())) {
      zero_copy(a);
      return res;
    }
    res.zero_copy = false;
    const size_t bytes = a.count * dtype_size(a.dtype);
    if (cma_ && a.kind == Kind::allreduce && bytes > cma_min_bytes_ && bytes <= cma_max_bytes_) {
      cma_allreduce(a);
      ++cma_calls_;
      return res;
    }
    // Software pipeline: the copy-out of step s-1 comes after the copy-in and reduction of step
    // s, so a rank that is a little behind its peers delays nobody's next step.
    for (size_t s = 0; s < steps; ++s) {
      k = ++round_;
      stage_step(a, k, s, e);
      publish(kIn, k);
      if (a.kind == Kind::broadcast) {
        if (rank_ != a.root) wait_all(kIn, k, what, a.root);
      } else {
        wait_all(kIn, k, what);
      }
      compute_step(a, k, s, e);
      if (s > 0) drain_step(a, k - 1, s - 1, e);
    }
    drain_step(a, k, steps - 1, e);
  } catch (const Timeout& t) {
    res.status = 2;
    res.message = t.what();
  } catch (const EngineFailure& f) {
    res.status = 3;
    res.message = f.what();
  }
  if (res.status >= 2) {
    broken_ = true;
    failed(rank_).store(static_cast<uint64_t>(res.status), std::memory_order_release);
  }
  return res;
}

}  // namespace mlf
