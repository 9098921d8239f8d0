// An engine's view of an installed libkvtier through the C++ API
// (kvtier/client.h): builds against the installed headers and libkvtier.so
// only. Usage: consumer [SOCKET]. Without SOCKET it checks what works
// offline; with it, it stores a prompt's blocks in a running kvtierd and
// loads them back. Exit 0 on success.
#include <kvtier/client.h>
#include <kvtier/shm_kv_cache.h>

#include <cstdio>
#include <cstring>
#include <numeric>
#include <vector>

namespace {

int Fail(const char* what, const kvtier::Status& status) {
  std::fprintf(stderr, "consumer: %s: %s\n", what, status.ToString().c_str());
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  kvtier::Result<kvtier::Layout> layout =
      kvtier::Layout::Create({.model_id = "kvtier/install-consumer",
                              .num_layers = 2,
                              .num_kv_heads = 2,
                              .head_dim = 64,
                              .dtype = kvtier::DType::kFp16,
                              .block_tokens = 16});
  if (!layout) return Fail("Layout::Create", layout.error());
  kvtier::Result<kvtier::ShmKvCache> cache = kvtier::ShmKvCache::Create(*layout, 8);
  if (!cache) return Fail("ShmKvCache::Create", cache.error());
  if (argc < 2) {
    // No daemon: connecting must fail cleanly with kUnavailable.
    auto client = kvtier::Client::Connect({.socket_path = "/nonexistent/kvtier/kvtierd.sock"});
    if (client || client.error().code() != kvtier::StatusCode::kUnavailable) {
      std::fprintf(stderr, "consumer: Connect to no daemon did not fail with kUnavailable\n");
      return 1;
    }
    std::printf("consumer: offline OK (%llu-byte blocks)\n",
                static_cast<unsigned long long>(cache->block_bytes()));
    return 0;
  }

  auto client =
      kvtier::Client::Connect({.socket_path = argv[1], .client_name = "install-consumer"});
  if (!client) return Fail("Connect", client.error());
  kvtier::Result<kvtier::CacheId> id = (*client)->RegisterKvCache(*cache);
  if (!id) return Fail("RegisterKvCache", id.error());
  std::vector<uint32_t> tokens(16 * 4);
  std::iota(tokens.begin(), tokens.end(), 1000u);
  auto keys = (*client)->ComputeKeys(*id, tokens);
  if (!keys) return Fail("ComputeKeys", keys.error());
  for (uint32_t b = 0; b < 4; ++b)
    std::memset(cache->block(b).data(), 0x30 + static_cast<int>(b), cache->block_bytes());
  const std::vector<uint32_t> stored_in = {0, 1, 2, 3}, loaded_in = {4, 5, 6, 7};
  auto stored = (*client)->Store(*id, *keys, stored_in);
  if (!stored) return Fail("Store", stored.error());
  auto hit = (*client)->Lookup(*id, *keys);
  if (!hit) return Fail("Lookup", hit.error());
  if (hit->hits != keys->size()) {
    std::fprintf(stderr, "consumer: %u of %zu keys hit\n", hit->hits, keys->size());
    return 1;
  }
  auto loaded = (*client)->Load(*id, *keys, loaded_in);
  if (!loaded) return Fail("Load", loaded.error());
  for (uint32_t b = 0; b < 4; ++b) {
    for (uint8_t byte : cache->block(loaded_in[b])) {
      if (byte != 0x30 + b) {
        std::fprintf(stderr, "consumer: block %u came back wrong\n", loaded_in[b]);
        return 1;
      }
    }
  }
  std::printf("consumer: stored, looked up and loaded %zu blocks as tenant %s\n", keys->size(),
              (*client)->tenant().c_str());
  return 0;
}
