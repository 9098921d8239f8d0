/* A C engine using libkvtier's C API: store a prompt's blocks, look them up,
 * load them back into other blocks and check every byte; then the same with
 * asynchronous store and load, and a prefetch. Compiled as C11 to
 * prove kvtier.h is plain C. Usage: c_api_example SOCKET. Exit 0 on success. */
#include <stdio.h>
#include <string.h>

#include "kvtier/kvtier.h"

#define CHECK(call)                                                              \
  do {                                                                           \
    kvtier_status s_ = (call);                                                   \
    if (s_ != KVTIER_OK) {                                                       \
      fprintf(stderr, "%s failed: %d %s\n", #call, (int)s_, kvtier_last_error()); \
      return 1;                                                                  \
    }                                                                            \
  } while (0)

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  kvtier_client* client = NULL;
  CHECK(kvtier_connect(argv[1], NULL, "c-example", &client));

  kvtier_layout layout = {"kvtier/c-example", 2, KVTIER_KV, 2, 64, KVTIER_FP16, 16, 0, 1, 0};
  kvtier_shm_cache* cache = NULL;
  CHECK(kvtier_shm_cache_create(&layout, 16, &cache));
  uint32_t cache_id = 0;
  CHECK(kvtier_register_shm_cache(client, cache, &cache_id));
  /* A codec the tenant allows (lossless, by default), and one it does not (fp8). */
  uint32_t coded_id = 0;
  CHECK(kvtier_register_shm_cache_coded(client, cache, KVTIER_CODEC_LOSSLESS, 0, &coded_id));
  if (kvtier_register_shm_cache_coded(client, cache, KVTIER_CODEC_FP8, 0, &coded_id) != KVTIER_PERMISSION_DENIED) {
    return 20;
  }
  if (kvtier_register_shm_cache_coded(client, cache, 7, 0, &coded_id) != KVTIER_INVALID_ARGUMENT) return 21;

  uint32_t tokens[16 * 4 + 5];
  for (size_t i = 0; i < sizeof(tokens) / sizeof(tokens[0]); ++i) tokens[i] = (uint32_t)(i * 7919u % 50000u);
  uint8_t keys[4 * 16];
  size_t num_keys = 0;
  CHECK(kvtier_compute_keys(client, cache_id, tokens, sizeof(tokens) / sizeof(tokens[0]), keys, 4, &num_keys));
  if (num_keys != 4) return 3;

  const uint64_t block_bytes = kvtier_shm_cache_block_bytes(cache);
  uint32_t ids[4] = {0, 1, 2, 3}, other[4] = {8, 9, 10, 11};
  for (uint32_t b = 0; b < 4; ++b) memset(kvtier_shm_cache_block(cache, b), (int)(0x40 + b), block_bytes);
  uint32_t stored = 0, already = 0;
  CHECK(kvtier_store(client, cache_id, keys, ids, 4, &stored, &already));
  if (stored != 4 || already != 0) return 4;

  uint32_t hits = 0;
  uint8_t tiers[4];
  CHECK(kvtier_lookup(client, cache_id, keys, 4, &hits, tiers));
  if (hits != 4 || tiers[0] != KVTIER_TIER_HOST) return 5;

  uint32_t loaded = 0;
  CHECK(kvtier_load(client, cache_id, keys, other, 4, &loaded));
  if (loaded != 4) return 6;
  for (uint32_t b = 0; b < 4; ++b) {
    const uint8_t* p = kvtier_shm_cache_block(cache, other[b]);
    for (uint64_t i = 0; i < block_bytes; ++i) {
      if (p[i] != 0x40 + b) return 7;
    }
  }
  /* Asynchronous: store four more blocks (chained to the first four) while
   * doing other work, prefetch, then load them back without blocking. */
  uint32_t more_tokens[16 * 4];
  for (size_t i = 0; i < 64; ++i) more_tokens[i] = (uint32_t)(i * 104729u % 50000u);
  uint8_t more_keys[4 * 16];
  CHECK(kvtier_compute_keys(client, cache_id, more_tokens, 64, more_keys, 4, &num_keys));
  uint32_t more_ids[4] = {4, 5, 6, 7}, more_other[4] = {12, 13, 14, 15};
  for (uint32_t b = 0; b < 4; ++b)
    memset(kvtier_shm_cache_block(cache, more_ids[b]), (int)(0x60 + b), block_bytes);
  kvtier_op op;
  CHECK(kvtier_store_async(client, cache_id, more_keys, more_ids, 4, keys + 3 * 16, &op));
  CHECK(kvtier_wait(client, &op, 0, &stored, &already));
  if (stored != 4 || already != 0) return 10;
  uint32_t cached = 0;
  CHECK(kvtier_prefetch(client, cache_id, more_keys, 4, &cached));
  if (cached != 4) return 11;
  CHECK(kvtier_load_async(client, cache_id, more_keys, more_other, 4, &op));
  CHECK(kvtier_wait(client, &op, 10000, &loaded, NULL));
  if (loaded != 4) return 12;
  for (uint32_t b = 0; b < 4; ++b) {
    const uint8_t* p = kvtier_shm_cache_block(cache, more_other[b]);
    for (uint64_t i = 0; i < block_bytes; ++i) {
      if (p[i] != 0x60 + b) return 13;
    }
  }
  /* A store with what KV events publish of its blocks: the engine's 8-byte
   * hash of each, the tokens, the block size. Sizes that do not match the
   * keys are refused. */
  uint32_t event_tokens[16 * 4];
  for (size_t i = 0; i < 64; ++i) event_tokens[i] = (uint32_t)(i * 15485863u % 50000u);
  uint8_t event_keys[4 * 16];
  CHECK(kvtier_compute_keys(client, cache_id, event_tokens, 64, event_keys, 4, &num_keys));
  uint8_t engine_hashes[4 * 8];
  for (size_t i = 0; i < sizeof(engine_hashes); ++i) engine_hashes[i] = (uint8_t)(i * 31u);
  uint32_t event_ids[4] = {8, 9, 10, 11};
  kvtier_block_events events = {.hash_bytes = 8, .engine_hashes = engine_hashes, .parent_hash = NULL,
                                .token_ids = event_tokens, .block_size = 16, .lora_name = "adapter-1"};
  CHECK(kvtier_store_events_async(client, cache_id, event_keys, event_ids, 4, NULL, &events, &op));
  CHECK(kvtier_wait(client, &op, 0, &stored, &already));
  if (stored != 4) {
    fprintf(stderr, "events store: %u stored, %u already\n", stored, already);
    return 15;
  }
  events.hash_bytes = 33;
  if (kvtier_store_events_async(client, cache_id, event_keys, event_ids, 4, NULL, &events, &op) !=
      KVTIER_INVALID_ARGUMENT) {
    return 16;
  }
  /* A store with a retention hint (kept until its next use, a partial last
   * block not stored), a hint for cached blocks, and hints refused. */
  uint32_t hint_tokens[16 * 3];
  for (size_t i = 0; i < 48; ++i) hint_tokens[i] = (uint32_t)(i * 7919u % 40000u + 3u);
  uint8_t hint_keys[3 * 16];
  CHECK(kvtier_compute_keys(client, cache_id, hint_tokens, 48, hint_keys, 3, &num_keys));
  uint32_t hint_ids[3] = {12, 13, 14};
  kvtier_hint hint = {.priority = 1, .next_use_ms = 60000, .session_over = 0, .last_partial = 1};
  CHECK(kvtier_store_hinted_async(client, cache_id, hint_keys, hint_ids, 3, NULL, NULL, &hint, &op));
  CHECK(kvtier_wait(client, &op, 0, &stored, &already));
  if (stored != 2) {
    fprintf(stderr, "hinted store: %u stored (the partial last block is not)\n", stored);
    return 30;
  }
  kvtier_hint over = {.priority = 0, .next_use_ms = 0, .session_over = 1, .last_partial = 0};
  uint32_t hinted = 0, refused = 0;
  CHECK(kvtier_hint_blocks(client, cache_id, hint_keys, 3, &over, &hinted, &refused));
  if (hinted != 2 || refused != 0) return 31;
  kvtier_hint bad_hint = {.priority = 300, .next_use_ms = 0, .session_over = 0, .last_partial = 0};
  if (kvtier_hint_blocks(client, cache_id, hint_keys, 3, &bad_hint, NULL, NULL) != KVTIER_INVALID_ARGUMENT) return 32;
  if (strstr(kvtier_last_error(), "priority 300") == NULL) return 33;
  bad_hint.priority = 0;
  bad_hint.next_use_ms = 3600001u;
  if (kvtier_store_hinted_async(client, cache_id, hint_keys, hint_ids, 3, NULL, NULL, &bad_hint, &op) !=
      KVTIER_INVALID_ARGUMENT) {
    return 34;
  }

  /* An op that is not this client's is an error, not a hang. */
  kvtier_op bogus = op;
  bogus.op += 1000;
  if (kvtier_wait(client, &bogus, 100, &loaded, NULL) == KVTIER_OK) return 14;

  /* Errors come back as codes with a message. */
  uint32_t bad[1] = {99};
  if (kvtier_load(client, cache_id, keys, bad, 1, &loaded) != KVTIER_OUT_OF_RANGE) return 8;
  if (strlen(kvtier_last_error()) == 0) return 9;

  kvtier_shm_cache_destroy(cache);
  kvtier_close(client);
  printf("c_api_example: ok\n");
  return 0;
}
