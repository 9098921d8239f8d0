/* A C engine's view of an installed libkvtier (kvtier/kvtier.h), compiled by
 * tools/check-install.sh with `pkg-config --cflags --libs kvtier` only.
 * Usage: c_consumer [SOCKET]. Without SOCKET, checks that connecting to no
 * daemon fails with KVTIER_UNAVAILABLE; with it, connects, registers a cache,
 * computes keys and looks them up (a miss: nothing was stored under this
 * layout). Exit 0 on success. */
#include <kvtier/kvtier.h>
#include <stdio.h>
#include <string.h>

int main(int argc, char** argv) {
  kvtier_layout layout = {
      "kvtier/install-c-consumer", 2, KVTIER_KV, 2, 64, KVTIER_FP16, 16, 0, 1, 0};
  kvtier_shm_cache* cache = NULL;
  if (kvtier_shm_cache_create(&layout, 4, &cache) != KVTIER_OK) {
    fprintf(stderr, "c_consumer: kvtier_shm_cache_create: %s\n", kvtier_last_error());
    return 1;
  }
  kvtier_client* client = NULL;
  const char* socket_path = argc > 1 ? argv[1] : "/nonexistent/kvtier/kvtierd.sock";
  kvtier_status st = kvtier_connect(socket_path, NULL, "install-c-consumer", &client);
  if (argc < 2) {
    kvtier_shm_cache_destroy(cache);
    if (st != KVTIER_UNAVAILABLE || strlen(kvtier_last_error()) == 0) {
      fprintf(stderr, "c_consumer: connect to no daemon gave %d\n", (int)st);
      return 1;
    }
    printf("c_consumer: offline OK\n");
    return 0;
  }
  if (st != KVTIER_OK) {
    fprintf(stderr, "c_consumer: kvtier_connect: %s\n", kvtier_last_error());
    return 1;
  }
  uint32_t cache_id = 0;
  uint32_t tokens[32];
  uint8_t keys[2 * 16];
  size_t num_keys = 0;
  uint32_t hits = 1;
  for (uint32_t i = 0; i < 32; ++i) tokens[i] = 7 * i;
  if (kvtier_register_shm_cache(client, cache, &cache_id) != KVTIER_OK ||
      kvtier_compute_keys(client, cache_id, tokens, 32, keys, 2, &num_keys) != KVTIER_OK ||
      kvtier_lookup(client, cache_id, keys, num_keys, &hits, NULL) != KVTIER_OK) {
    fprintf(stderr, "c_consumer: %s\n", kvtier_last_error());
    return 1;
  }
  kvtier_close(client);
  kvtier_shm_cache_destroy(cache);
  if (num_keys != 2 || hits != 0) {
    fprintf(stderr, "c_consumer: %zu keys, %u hits (expected 2 keys, no hits)\n", num_keys, hits);
    return 1;
  }
  printf("c_consumer: connected, registered, computed %zu keys, lookup missed as expected\n",
         num_keys);
  return 0;
}
