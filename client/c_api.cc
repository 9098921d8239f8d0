// The C API (kvtier/kvtier.h) over kvtier::Client.
#include <chrono>
#include <cstring>
#include <optional>
#include <string>

#include "kvtier/client.h"
#include "kvtier/kvtier.h"

struct kvtier_client {
  std::unique_ptr<kvtier::Client> client;
};

struct kvtier_shm_cache {
  kvtier::ShmKvCache cache;
};

namespace {

thread_local std::string last_error;

kvtier_status Fail(const kvtier::Status& status) {
  last_error = status.ToString();
  return static_cast<kvtier_status>(status.code());
}

kvtier_status Fail(kvtier::StatusCode code, const char* message) {
  return Fail(kvtier::Status(code, message));
}

std::vector<kvtier::BlockKey> Keys(const uint8_t* keys, size_t n) {
  std::vector<kvtier::BlockKey> out(n);
  for (size_t i = 0; i < n; ++i) std::memcpy(out[i].bytes.data(), keys + 16 * i, 16);
  return out;
}

// A C hint as the client's (which checks it).
kvtier::BlockHint HintFromC(const kvtier_hint& h) {
  return kvtier::BlockHint{.priority = h.priority,
                           .next_use_ms = h.next_use_ms,
                           .session_over = h.session_over != 0,
                           .last_partial = h.last_partial != 0};
}
}  // namespace

extern "C" {

const char* kvtier_last_error(void) { return last_error.c_str(); }

kvtier_status kvtier_connect(const char* socket_path, const char* token, const char* client_name,
                             kvtier_client** out) {
  if (socket_path == nullptr || out == nullptr) return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  kvtier::ClientOptions options{.socket_path = socket_path,
                                .token = token != nullptr ? token : "",
                                .client_name = client_name != nullptr ? client_name : ""};
  kvtier::Result<std::unique_ptr<kvtier::Client>> c = kvtier::Client::Connect(std::move(options));
  if (!c) return Fail(c.error());
  *out = new kvtier_client{std::move(*c)};
  return KVTIER_OK;
}

void kvtier_close(kvtier_client* client) { delete client; }

kvtier_status kvtier_shm_cache_create(const kvtier_layout* l, uint32_t num_blocks, kvtier_shm_cache** out) {
  if (l == nullptr || out == nullptr || l->model_id == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::LayoutSpec spec{.model_id = l->model_id,
                          .num_layers = l->num_layers,
                          .kv_kind = static_cast<kvtier::KvKind>(l->kv_kind),
                          .num_kv_heads = l->num_kv_heads,
                          .head_dim = l->head_dim,
                          .dtype = static_cast<kvtier::DType>(l->dtype),
                          .block_tokens = l->block_tokens,
                          .tp_rank = l->tp_rank,
                          .tp_size = l->tp_size,
                          .scale_bytes_per_layer = l->scale_bytes_per_layer};
  kvtier::Result<kvtier::Layout> layout = kvtier::Layout::Create(std::move(spec));
  if (!layout) return Fail(layout.error());
  kvtier::Result<kvtier::ShmKvCache> cache = kvtier::ShmKvCache::Create(*layout, num_blocks);
  if (!cache) return Fail(cache.error());
  *out = new kvtier_shm_cache{std::move(*cache)};
  return KVTIER_OK;
}

void kvtier_shm_cache_destroy(kvtier_shm_cache* cache) { delete cache; }

uint8_t* kvtier_shm_cache_block(kvtier_shm_cache* cache, uint32_t block_id) {
  if (cache == nullptr || block_id >= cache->cache.num_blocks()) return nullptr;
  return cache->cache.block(block_id).data();
}

uint64_t kvtier_shm_cache_block_bytes(const kvtier_shm_cache* cache) {
  return cache == nullptr ? 0 : cache->cache.block_bytes();
}

kvtier_status kvtier_register_shm_cache(kvtier_client* client, const kvtier_shm_cache* cache, uint32_t* cache_id) {
  return kvtier_register_shm_cache_coded(client, cache, KVTIER_CODEC_NONE, 0, cache_id);
}

kvtier_status kvtier_register_shm_cache_coded(kvtier_client* client, const kvtier_shm_cache* cache, int codec,
                                              uint32_t fp8_group, uint32_t* cache_id) {
  if (client == nullptr || cache == nullptr || cache_id == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  if (codec != KVTIER_CODEC_NONE && codec != KVTIER_CODEC_LOSSLESS && codec != KVTIER_CODEC_FP8) {
    return Fail(kvtier::InvalidArgument("unknown codec " + std::to_string(codec)));
  }
  kvtier::Result<kvtier::CacheId> id = client->client->RegisterKvCache(
      cache->cache, {.kind = static_cast<kvtier::CodecKind>(codec), .fp8_group = fp8_group});
  if (!id) return Fail(id.error());
  *cache_id = *id;
  return KVTIER_OK;
}

kvtier_status kvtier_compute_keys(kvtier_client* client, uint32_t cache_id, const uint32_t* tokens,
                                  size_t num_tokens, uint8_t* keys_out, size_t max_keys, size_t* num_keys) {
  if (client == nullptr || (tokens == nullptr && num_tokens > 0) || num_keys == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::Result<std::vector<kvtier::BlockKey>> keys =
      client->client->ComputeKeys(cache_id, std::span<const uint32_t>(tokens, num_tokens));
  if (!keys) return Fail(keys.error());
  if (keys->size() > max_keys || (keys_out == nullptr && !keys->empty())) {
    *num_keys = keys->size();
    return Fail(kvtier::StatusCode::kOutOfRange, "keys_out has room for fewer keys than there are full blocks");
  }
  for (size_t i = 0; i < keys->size(); ++i) std::memcpy(keys_out + 16 * i, (*keys)[i].bytes.data(), 16);
  *num_keys = keys->size();
  return KVTIER_OK;
}

kvtier_status kvtier_lookup(kvtier_client* client, uint32_t cache_id, const uint8_t* keys, size_t num_keys,
                            uint32_t* hits, uint8_t* tiers_out) {
  if (client == nullptr || (keys == nullptr && num_keys > 0) || hits == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::Result<kvtier::LookupResult> r = client->client->Lookup(cache_id, Keys(keys, num_keys));
  if (!r) return Fail(r.error());
  *hits = r->hits;
  if (tiers_out != nullptr) {
    for (size_t i = 0; i < r->tiers.size(); ++i) tiers_out[i] = static_cast<uint8_t>(r->tiers[i]);
  }
  return KVTIER_OK;
}

kvtier_status kvtier_load(kvtier_client* client, uint32_t cache_id, const uint8_t* keys, const uint32_t* block_ids,
                          size_t n, uint32_t* blocks) {
  if (client == nullptr || (n > 0 && (keys == nullptr || block_ids == nullptr)) || blocks == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::Result<kvtier::OpResult> r =
      client->client->Load(cache_id, Keys(keys, n), std::span<const uint32_t>(block_ids, n));
  if (!r) return Fail(r.error());
  *blocks = r->blocks;
  return KVTIER_OK;
}

kvtier_status kvtier_store(kvtier_client* client, uint32_t cache_id, const uint8_t* keys, const uint32_t* block_ids,
                           size_t n, uint32_t* blocks, uint32_t* already) {
  if (client == nullptr || (n > 0 && (keys == nullptr || block_ids == nullptr)) || blocks == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::Result<kvtier::OpResult> r =
      client->client->Store(cache_id, Keys(keys, n), std::span<const uint32_t>(block_ids, n));
  if (!r) return Fail(r.error());
  *blocks = r->blocks;
  if (already != nullptr) *already = r->already;
  return KVTIER_OK;
}

kvtier_status kvtier_prefetch(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                              size_t num_keys, uint32_t* cached) {
  if (client == nullptr || (keys == nullptr && num_keys > 0)) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::Result<uint32_t> r = client->client->Prefetch(cache_id, Keys(keys, num_keys));
  if (!r) return Fail(r.error());
  if (cached != nullptr) *cached = *r;
  return KVTIER_OK;
}

kvtier_status kvtier_load_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                const uint32_t* block_ids, size_t n, kvtier_op* op) {
  if (client == nullptr || (n > 0 && (keys == nullptr || block_ids == nullptr)) || op == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::Result<kvtier::OpHandle> r =
      client->client->LoadAsync(cache_id, Keys(keys, n), std::span<const uint32_t>(block_ids, n));
  if (!r) return Fail(r.error());
  *op = kvtier_op{.op = r->op, .connection = r->connection};
  return KVTIER_OK;
}

kvtier_status kvtier_store_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                 const uint32_t* block_ids, size_t n, const uint8_t* parent,
                                 kvtier_op* op) {
  return kvtier_store_events_async(client, cache_id, keys, block_ids, n, parent, nullptr, op);
}

kvtier_status kvtier_store_events_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                        const uint32_t* block_ids, size_t n, const uint8_t* parent,
                                        const kvtier_block_events* events, kvtier_op* op) {
  return kvtier_store_hinted_async(client, cache_id, keys, block_ids, n, parent, events, nullptr, op);
}

kvtier_status kvtier_hint_blocks(kvtier_client* client, uint32_t cache_id, const uint8_t* keys, size_t n,
                                 const kvtier_hint* hint, uint32_t* hinted, uint32_t* refused) {
  if (client == nullptr || (keys == nullptr && n > 0) || hint == nullptr) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  kvtier::Result<kvtier::HintResult> r = client->client->Hint(cache_id, Keys(keys, n), HintFromC(*hint));
  if (!r) return Fail(r.error());
  if (hinted != nullptr) *hinted = r->hinted;
  if (refused != nullptr) *refused = r->refused;
  return KVTIER_OK;
}

kvtier_status kvtier_store_hinted_async(kvtier_client* client, uint32_t cache_id, const uint8_t* keys,
                                        const uint32_t* block_ids, size_t n, const uint8_t* parent,
                                        const kvtier_block_events* events, const kvtier_hint* hint,
                                        kvtier_op* op) {
  std::optional<kvtier::BlockHint> block_hint;
  if (hint != nullptr) block_hint = HintFromC(*hint);
  if (client == nullptr || (n > 0 && (keys == nullptr || block_ids == nullptr)) || op == nullptr ||
      (events != nullptr && n > 0 && events->engine_hashes == nullptr)) {
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  }
  std::optional<kvtier::BlockKey> parent_key;
  if (parent != nullptr) parent_key = Keys(parent, 1).front();
  kvtier::BlockEventInfo info;
  if (events != nullptr) {
    const size_t width = events->hash_bytes;
    info.hash_bytes = events->hash_bytes;
    info.engine_hashes = {events->engine_hashes, events->engine_hashes == nullptr ? 0 : n * width};
    if (events->parent_hash != nullptr) info.parent_hash = {events->parent_hash, width};
    if (events->token_ids != nullptr) info.token_ids = {events->token_ids, n * size_t{events->block_size}};
    info.block_size = events->block_size;
    if (events->lora_name != nullptr) info.lora_name = events->lora_name;
  }
  kvtier::Result<kvtier::OpHandle> r =
      client->client->StoreAsync(cache_id, Keys(keys, n), std::span<const uint32_t>(block_ids, n), parent_key,
                                 events != nullptr ? &info : nullptr, block_hint ? &*block_hint : nullptr);
  if (!r) return Fail(r.error());
  *op = kvtier_op{.op = r->op, .connection = r->connection};
  return KVTIER_OK;
}

kvtier_status kvtier_wait(kvtier_client* client, const kvtier_op* op, uint32_t timeout_ms,
                          uint32_t* blocks, uint32_t* already) {
  if (client == nullptr || op == nullptr)
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  kvtier::Result<kvtier::OpResult> r =
      client->client->Wait(kvtier::OpHandle{.op = op->op, .connection = op->connection},
                           std::chrono::milliseconds(timeout_ms));
  if (!r) return Fail(r.error());
  if (blocks != nullptr) *blocks = r->blocks;
  if (already != nullptr) *already = r->already;
  return KVTIER_OK;
}

kvtier_status kvtier_cancel(kvtier_client* client, const kvtier_op* op, uint32_t timeout_ms) {
  if (client == nullptr || op == nullptr)
    return Fail(kvtier::StatusCode::kInvalidArgument, "NULL argument");
  const kvtier::Status st = client->client->Cancel(kvtier::OpHandle{.op = op->op, .connection = op->connection},
                                                   std::chrono::milliseconds(timeout_ms));
  return st.ok() ? KVTIER_OK : Fail(st);
}

}  // extern "C"
