/* kvtier C API: libkvtier for engines written in C, Python (ctypes/cffi), Rust
 * or Go. A thin layer over kvtier::Client (kvtier/client.h); see that header
 * for the semantics of each call.
 *
 * Every function returns a kvtier_status: 0 on success, otherwise a code with
 * the numbering of kvtier::StatusCode (KVTIER_UNAVAILABLE means the daemon is
 * restarting: treat it as a cache miss). kvtier_last_error() gives the
 * message of the calling thread's last failure.
 *
 * Keys are 16-byte arrays (docs/hashing.md). A kvtier_client is thread-safe;
 * a kvtier_shm_cache is thread-compatible. */
#ifndef KVTIER_KVTIER_H_
#define KVTIER_KVTIER_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int32_t kvtier_status;
enum {
  KVTIER_OK = 0,
  KVTIER_INVALID_ARGUMENT = 1,
  KVTIER_NOT_FOUND = 2,
  KVTIER_ALREADY_EXISTS = 3,
  KVTIER_RESOURCE_EXHAUSTED = 4,
  KVTIER_FAILED_PRECONDITION = 5,
  KVTIER_OUT_OF_RANGE = 6,
  KVTIER_PERMISSION_DENIED = 7,
  KVTIER_UNAUTHENTICATED = 8,
  KVTIER_UNAVAILABLE = 9,
  KVTIER_DEADLINE_EXCEEDED = 10,
  KVTIER_INTERNAL = 16
};

enum { KVTIER_KV = 1, KVTIER_LATENT = 2 };
enum { KVTIER_FP16 = 1, KVTIER_BF16 = 2, KVTIER_FP32 = 3, KVTIER_FP8_E4M3 = 4, KVTIER_FP8_E5M2 = 5 };
enum { KVTIER_TIER_HBM = 1, KVTIER_TIER_HOST = 2, KVTIER_TIER_DISK = 3 };

typedef struct kvtier_layout {
  const char* model_id;
  uint32_t num_layers;
  uint8_t kv_kind; /* KVTIER_KV or KVTIER_LATENT */
  uint32_t num_kv_heads;
  uint32_t head_dim;
  uint8_t dtype; /* KVTIER_FP16 ... */
  uint32_t block_tokens;
  uint32_t tp_rank;
  uint32_t tp_size;
  uint32_t scale_bytes_per_layer;
} kvtier_layout;

typedef struct kvtier_client kvtier_client;
typedef struct kvtier_shm_cache kvtier_shm_cache;

/* The calling thread's last error message ("" if none). Valid until the next
 * failing call on this thread. */
const char* kvtier_last_error(void);

/* token and client_name may be NULL. */
kvtier_status kvtier_connect(const char* socket_path, const char* token, const char* client_name,
                             kvtier_client** out);
void kvtier_close(kvtier_client* client);

/* A memfd-backed KV cache for CPU engines: num_blocks contiguous blocks. */
kvtier_status kvtier_shm_cache_create(const kvtier_layout* layout, uint32_t num_blocks,
                                      kvtier_shm_cache** out);
void kvtier_shm_cache_destroy(kvtier_shm_cache* cache);
uint8_t* kvtier_shm_cache_block(kvtier_shm_cache* cache, uint32_t block_id);
uint64_t kvtier_shm_cache_block_bytes(const kvtier_shm_cache* cache);

/* Registers the cache with the daemon; *cache_id names it in later calls. */
kvtier_status kvtier_register_shm_cache(kvtier_client* client, const kvtier_shm_cache* cache,
                                        uint32_t* cache_id);

/* How the daemon stores a cache's blocks on disk (docs/compression.md):
 * as they are; lossless (bit-exact); fp8 (LOSSY: E4M3 with one scale per
 * fp8_group elements, 0 = head_dim; fp16 and bf16 caches only). The tenant's
 * config must allow it (KVTIER_PERMISSION_DENIED otherwise). */
enum { KVTIER_CODEC_NONE = 0, KVTIER_CODEC_LOSSLESS = 1, KVTIER_CODEC_FP8 = 2 };
kvtier_status kvtier_register_shm_cache_coded(kvtier_client* client, const kvtier_shm_cache* cache, int codec,
                                              uint32_t fp8_group, uint32_t* cache_id);

/* Chain keys of the full blocks of tokens: writes up to max_keys keys
 * (16 bytes each) to keys_out and their number to *num_keys. */
kvtier_status kvtier_compute_keys(kvtier_client* client, uint32_t cache_id, const uint32_t* tokens,
                                  size_t num_tokens, uint8_t* keys_out, size_t max_keys,
                                  size_t* num_keys);

/* *hits = number of leading keys cached; tiers_out (may be NULL, else room
 * for num_keys) gets each hit's KVTIER_TIER_*. Never pins. */
kvtier_status kvtier_lookup(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                            size_t num_keys, uint32_t* hits, uint8_t* tiers_out);

/* Blocking load and store of keys[i] <-> engine block block_ids[i].
 * *blocks: blocks loaded / newly stored; *already (may be NULL): keys
 * already stored. */
kvtier_status kvtier_load(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                          const uint32_t* block_ids, size_t n, uint32_t* blocks);
kvtier_status kvtier_store(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                           const uint32_t* block_ids, size_t n, uint32_t* blocks, uint32_t* already);

/* Starts moving the cached blocks of keys to faster tiers (e.g. disk to host
 * before a load). *cached (may be NULL): how many leading keys are cached. */
kvtier_status kvtier_prefetch(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                              size_t num_keys, uint32_t* cached);

/* An operation in flight: started by kvtier_load_async or
 * kvtier_store_async, finished by kvtier_wait. Plain values, to copy freely. */
typedef struct kvtier_op {
  uint64_t op;
  uint64_t connection;
} kvtier_op;

/* As kvtier_load and kvtier_store, without waiting: the engine may run
 * while the copies run, and must not touch the blocks until kvtier_wait has
 * returned. parent (16 bytes, may be NULL): the key before keys[0], for
 * prefix-aware eviction. */
kvtier_status kvtier_load_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                const uint32_t* block_ids, size_t n, kvtier_op* op);
kvtier_status kvtier_store_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                 const uint32_t* block_ids, size_t n, const uint8_t* parent,
                                 kvtier_op* op);

/* What a KV-aware router needs of the blocks of a store (KV events,
 * docs/kv-events.md): every hash has hash_bytes bytes (1-32);
 * engine_hashes: hash_bytes per key; parent_hash: the engine's hash of the
 * block before keys[0], or NULL; token_ids: block_size per key, or NULL;
 * lora_name: NUL-terminated, or NULL. */
typedef struct kvtier_block_events {
  uint32_t hash_bytes;
  const uint8_t* engine_hashes;
  const uint8_t* parent_hash;
  const uint32_t* token_ids;
  uint32_t block_size;
  const char* lora_name;
} kvtier_block_events;

/* kvtier_store_async, with what KV events publish of the blocks (events may
 * be NULL: as kvtier_store_async). */
kvtier_status kvtier_store_events_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                        const uint32_t* block_ids, size_t n, const uint8_t* parent,
                                        const kvtier_block_events* events, kvtier_op* op);

/* The engine's retention hint (docs/policy.md); all zero: none.
 * priority: -1 evict these before unhinted blocks, 0 none, 1 keep them
 * over unhinted blocks. next_use_ms: their next use is expected within this
 * many ms (0: none; at most 3,600,000): kept until a hit or twice this long.
 * session_over (kvtier_hint_blocks only): no use expected, evict first (a
 * hit undoes it). last_partial (stores only): the last key's block covers
 * part of a block's tokens and is not stored. */
typedef struct kvtier_hint {
  int32_t priority;
  uint32_t next_use_ms;
  int32_t session_over;
  int32_t last_partial;
} kvtier_hint;

/* kvtier_store_events_async with a retention hint for the new blocks
 * (events and hint may be NULL). */
kvtier_status kvtier_store_hinted_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                        const uint32_t* block_ids, size_t n, const uint8_t* parent,
                                        const kvtier_block_events* events, const kvtier_hint* hint,
                                        kvtier_op* op);

/* A retention hint for the cached blocks of keys (a request's, or a
 * finished session's), replacing theirs; keys not cached are skipped.
 * *hinted: blocks that took it; *refused: of which hinted to be kept past
 * the tier's share (either may be NULL). */
kvtier_status kvtier_hint_blocks(kvtier_client* client, uint32_t cache_id, const uint8_t* keys, size_t n,
                                 const kvtier_hint* hint, uint32_t* hinted, uint32_t* refused);

/* Waits for an op, at most timeout_ms (0: no limit). KVTIER_DEADLINE_EXCEEDED:
 * still running, wait again (or kvtier_cancel); KVTIER_UNAVAILABLE: the
 * connection was lost (the daemon restarted), the op is lost (a load loaded
 * nothing usable, a store stored nothing). After any error but
 * KVTIER_DEADLINE_EXCEEDED no copy of the op touches its blocks any more.
 * *blocks and *already (either may be NULL) as for kvtier_load and
 * kvtier_store. */
kvtier_status kvtier_wait(kvtier_client* client, const kvtier_op* op, uint32_t timeout_ms,
                          uint32_t* blocks, uint32_t* already);

/* Cancels an op without the daemon (it works while kvtierd is hung): its
 * copies not started never start, and this waits at most timeout_ms (0: no
 * limit) for any in progress. KVTIER_OK: the daemon never touches the op's
 * blocks again, and the engine may reuse them; the op need not be waited
 * for. KVTIER_DEADLINE_EXCEEDED: a copy is still in progress (kvtierd
 * stopped in the middle of it); the blocks are not safe yet, cancel again. */
kvtier_status kvtier_cancel(kvtier_client* client, const kvtier_op* op, uint32_t timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* KVTIER_KVTIER_H_ */
