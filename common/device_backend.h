// DeviceBackend: the seam between kvtier's logic and the memory it moves.
//
// Two implementations: `host` (devices/host_backend.h: arenas in process
// memory, engine caches in memfd shared memory, copies on worker threads) and
// `cuda` (device arenas, pinned host memory, CUDA IPC, batched kernels).
// Everything above this interface is tested on `host`.
//
// Ownership: arenas and client mappings are returned as unique_ptr/shared_ptr
// and released by destruction. A CopyBatch keeps the mapping it reads or
// writes alive (shared_ptr) until its completion has run, so a client that
// dies mid-copy never leaves the daemon with a dangling mapping, and its
// memory is unmapped when the last copy touching it is done.
//
// Implementations are thread-safe.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/kv_cache_layout.h"
#include "common/layer_gate.h"
#include "common/op_fence.h"
#include "common/status.h"
#include "common/unique_fd.h"

namespace kvtier {

// A contiguous arena owned by the backend (the hbm pool of one device, or the
// node's pinned host pool). The bytes are valid until destruction.
class Arena {
 public:
  virtual ~Arena() = default;
  virtual uint8_t* data() const = 0;
  virtual uint64_t size_bytes() const = 0;
};

enum class ClientMemoryKind : uint8_t { kHostMemfd = 1, kCudaIpc = 2 };

// One memory region an engine registered, as received over the socket.
struct ClientRegionHandle {
  static constexpr size_t kCudaIpcHandleBytes = 64;  // sizeof(cudaIpcMemHandle_t)
  ClientMemoryKind kind = ClientMemoryKind::kHostMemfd;
  uint64_t size_bytes = 0;
  UniqueFd memfd;                                        // kHostMemfd
  std::array<uint8_t, kCudaIpcHandleBytes> cuda_ipc_handle{};  // kCudaIpc
  uint64_t cuda_offset = 0;
  int device = 0;                                  // the client's ordinal
  std::array<uint8_t, 16> device_uuid{};          // names the device across processes
  bool has_device_uuid = false;
  // kCudaIpc: the tenant registering it. One tenant's opened handle (and its
  // events) is never shared with another tenant presenting the same bytes.
  std::string owner;
};

// A CUDA IPC event handle (cudaIpcEventHandle_t) an engine exported: an
// event created with cudaEventInterprocess | cudaEventDisableTiming.
using IpcEventHandle = std::array<uint8_t, 64>;

// A client's registered regions (and, on `cuda`, its IPC events), mapped into
// the daemon.
class ClientMapping {
 public:
  virtual ~ClientMapping() = default;
  // Base address of each region, in registration order.
  virtual std::span<uint8_t* const> region_bases() const = 0;
  // Events opened from the client's handles (CopyBatch::wait_event and
  // signal_event index them).
  virtual uint32_t num_events() const { return 0; }
};

// One block copy between an engine block and a kvtier slot.
struct BlockCopy {
  uint32_t engine_block = 0;
  uint8_t* slot = nullptr;  // block_bytes of kvtier memory (an arena slot)
  // kSlotToEngine: the slot holds CopyBatch::codec's output of this many
  // bytes, decoded into the engine's pages. kEngineToSlot: the block is to
  // be coded by CopyBatch::codec into the slot, of this many bytes
  // (EncodesOnStore). 0: the block as it is.
  uint32_t coded_bytes = 0;
};

// One copy between two kvtier slots (demotion, promotion).
struct SlotCopy {
  const uint8_t* src = nullptr;
  uint8_t* dst = nullptr;
  uint64_t size_bytes = 0;
};

enum class CopyDirection : uint8_t {
  kEngineToSlot,  // store: gather engine pages into slots
  kSlotToEngine,  // load: scatter slots into engine pages
  kSlotToSlot,    // between tiers
};

// Loads run ahead of stores, and both ahead of background moves, so an engine
// waiting for a load never queues behind bulk work.
enum class CopyPriority : uint8_t { kLoad = 0, kStore = 1, kBackground = 2 };
inline constexpr size_t kNumCopyPriorities = 3;

struct CopyBatch {
  CopyDirection direction = CopyDirection::kSlotToSlot;
  CopyPriority priority = CopyPriority::kBackground;
  // Whose copies these are (kvtierd: the tenant's id). `host` serves the
  // flows of one priority in turn, so one tenant's burst of copies delays
  // another's by at most a task per worker, not by the whole burst.
  uint32_t flow = 0;
  // Engine copies: the layout and mapping (kept alive until completion).
  std::shared_ptr<const KvCacheLayout> layout = nullptr;
  std::shared_ptr<ClientMapping> mapping = nullptr;
  std::vector<BlockCopy> blocks = {};
  // Slot copies.
  std::vector<SlotCopy> slot_copies = {};
  // Compute the XXH3-64 of every destination slot in host memory after
  // copying (blocks reaching host memory carry a checksum from then on). A
  // destination in device memory may get 0: hbm blocks are checksummed when
  // they move to host.
  bool checksum_destination = false;
  // `cuda` only, indexes into the mapping's events (-1: none). The copies
  // start only once the engine's last record of wait_event has completed (a
  // store reads what the engine's stream wrote; the backend watches it from
  // the host, so one engine's slow stream never holds up another's copies).
  // signal_event is recorded on the copy stream after the copies, before
  // Submit returns, so that a reply sent after Submit may tell the engine's
  // stream to wait for a load on the GPU. A batch has one or the other.
  int32_t wait_event = -1;
  int32_t signal_event = -1;
  // What the blocks with coded_bytes hold (kSlotToEngine, DecodesOnLoad) or
  // are to hold (kEngineToSlot, EncodesOnStore).
  CodecParams codec = {};
  // Engine copies: the client's fence for them (common/op_fence.h). A copy
  // touches the engine's memory only from a successful Enter to its entry's
  // release; refused, the batch fails with kCancelled and copies no more.
  OpFence fence = {};
  // kSlotToEngine: copy layer by layer (every block's layer l before any
  // block's layer l + 1) and report each layer once it is in place in every
  // block through fence.Progress, so that the engine computes layer l while
  // later layers are still being copied. A backend may copy a batch whole
  // instead (and report nothing): the daemon reports every layer once the
  // batch is done.
  bool by_layer = false;
  // kEngineToSlot, a store by layer (GatesStoreLayers): layer l of the
  // engine's blocks is written only once the gate has opened l + 1 layers,
  // and is copied then, while later layers compute. A gate that aborts
  // fails the batch with kCancelled (nothing copied after is of use).
  std::shared_ptr<LayerGate> gate = nullptr;
};

struct CopyResult {
  Status status = Status::Ok();
  // With checksum_destination: one per block / slot copy, in order (of the
  // coded bytes for a coded block).
  std::vector<uint64_t> checksums = {};
  // kEngineToSlot: the blocks asked to be coded that the codec does not
  // code (fp8: a NaN or an Inf), as indexes into `blocks`, ascending. Their
  // slots hold nothing of use; the block is to be stored as it is.
  std::vector<uint32_t> not_coded = {};
};

using CopyDone = std::function<void(CopyResult)>;

class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;

  virtual std::string_view name() const = 0;
  // For logs and Stats: the devices and driver ("cuda: NVIDIA H200 (sm_90,
  // 139.8 GiB), driver 13.0") or the copy threads.
  virtual std::string Describe() const = 0;

  // The hbm pool of one device (on `host`, process memory standing in).
  virtual Result<std::unique_ptr<Arena>> AllocateDeviceArena(int device, uint64_t size_bytes) = 0;
  // The node's host pool (pinned on `cuda`).
  virtual Result<std::unique_ptr<Arena>> AllocateHostArena(uint64_t size_bytes) = 0;

  // Maps an engine's regions. Errors: kInvalidArgument for a handle of the
  // wrong kind for this backend, a region smaller than claimed, or (host) a
  // memfd that is not sealed against shrinking (F_SEAL_SHRINK), since a
  // client that truncates its memory under a copy would crash the daemon;
  // events on a backend without them (host).
  virtual Result<std::shared_ptr<ClientMapping>> MapClientMemory(std::vector<ClientRegionHandle> regions,
                                                                 std::vector<IpcEventHandle> events) = 0;

  // Runs the copies asynchronously; `done` runs exactly once, on a backend
  // thread, after every byte is copied (or with the error that stopped it).
  // Batches run by priority, FIFO within one priority. Returns false when the
  // batch failed before its copies (and signal_event) were queued; `done`
  // then reports why. True says signal_event, if any, has been recorded.
  virtual bool Submit(CopyBatch batch, CopyDone done) = 0;

  // Whether a kSlotToEngine batch may hold blocks coded by `kind`, decoded
  // on their way into the engine's pages (no raw copy of them in between).
  // A decode that fails fails the batch with kCorruption.
  virtual bool DecodesOnLoad(CodecKind kind) const { return kind == CodecKind::kNone; }

  // Whether a kEngineToSlot batch may carry a LayerGate (CopyBatch::gate):
  // stores by layer. A backend without them is never given one.
  virtual bool GatesStoreLayers() const { return false; }

  // Whether a kEngineToSlot batch may ask for blocks coded by `kind` into
  // slots of their coded size (BlockCopy::coded_bytes), coded on the copy's
  // way (no raw copy of them in host memory, no CPU pass); blocks the codec
  // does not code are reported (CopyResult::not_coded). Only for codecs
  // whose output has one size per block size (fp8).
  virtual bool EncodesOnStore(CodecKind /*kind*/) const { return false; }

  // Live client mappings (for Stats: a dead client's must reach zero).
  virtual uint64_t live_mappings() const = 0;

  // Ok while the backend can copy; otherwise why it never will again in
  // this process (cuda: a sticky error lost a device's context, and only a
  // new process gets a new one). Batches then fail with that status; the
  // daemon stops, writing its host blocks to disk, and exits non-zero for
  // its supervisor to start it again. Cheap: the event loop asks every turn.
  virtual Status health() const { return Status::Ok(); }
};

}  // namespace kvtier
