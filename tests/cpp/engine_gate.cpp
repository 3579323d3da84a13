// The C++ engine's gate: a toy inference engine that keeps its prompt-prefix KV blocks
// in Mooncake through moongate (libmoongate_kv), restarts, finds the prefix, loads the
// blocks byte-identical and produces the same output as without the cache.
//
//   engine_gate ADDRESS store SEED BLOCKS   compute the prompt's KV blocks, store them,
//                                           print "output <n>" (computed from scratch)
//   engine_gate ADDRESS load SEED BLOCKS    look the prefix up, load the blocks into the
//                                           engine's registered buffer, check them, and
//                                           print "hits <h>/<blocks>" and "output <n>"
//
// The "model" is deterministic: block i's KV is a function of every token up to the
// end of block i (so a block is only valid after its whole prefix), and the output is a
// function of all blocks and the prompt's last tokens. Exit 0 when every check holds.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "moongate_kv.h"

namespace {

constexpr size_t kTokensPerBlock = 16;
constexpr size_t kBlockBytes = 256 * 1024;  // one block's K and V, all layers

uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

std::vector<uint32_t> prompt(uint64_t seed, size_t blocks) {
  std::vector<uint32_t> t(blocks * kTokensPerBlock + 3);
  for (size_t i = 0; i < t.size(); i++) t[i] = static_cast<uint32_t>(mix(seed * 1000003 + i) % 50000);
  return t;
}

// The hash of every token up to the end of block i: the block's identity (as vLLM's
// block hashes chain), also its key.
std::vector<uint64_t> block_hashes(const std::vector<uint32_t>& t, size_t blocks) {
  std::vector<uint64_t> h(blocks);
  uint64_t acc = 0xcbf29ce484222325ULL;
  for (size_t b = 0; b < blocks; b++) {
    for (size_t i = b * kTokensPerBlock; i < (b + 1) * kTokensPerBlock; i++) acc = mix(acc ^ t[i]);
    h[b] = acc;
  }
  return h;
}

// "Attention": a block's KV from its chain hash (the expensive part a cache saves).
void compute_block(uint64_t hash, unsigned char* out) {
  uint64_t s = hash;
  for (size_t i = 0; i < kBlockBytes; i += 8) {
    s = mix(s);
    std::memcpy(out + i, &s, 8);
  }
}

uint64_t output(const unsigned char* kv, size_t blocks, const std::vector<uint32_t>& t) {
  uint64_t acc = 0;
  for (size_t b = 0; b < blocks; b++) {
    const unsigned char* blk = kv + b * kBlockBytes;
    for (size_t i = 0; i < kBlockBytes; i += 4096) {
      uint64_t w;
      std::memcpy(&w, blk + i, 8);
      acc = mix(acc ^ w);
    }
  }
  for (size_t i = t.size() - 3; i < t.size(); i++) acc = mix(acc ^ t[i]);
  return acc % 50000;
}

std::string key_of(uint64_t seed, uint64_t h) {
  char k[96];
  std::snprintf(k, sizeof k, "gate/%llu/%016llx", static_cast<unsigned long long>(seed),
                static_cast<unsigned long long>(h));
  return k;
}

// The client handle, closed on every exit path.
struct Client {
  mg_client* c;
  explicit Client(const char* address) : c(mg_connect(address)) {
    if (!c) throw std::runtime_error(std::string("mg_connect: ") + mg_last_error(nullptr));
  }
  ~Client() { mg_close(c); }
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;
  std::string error() const { return mg_last_error(c); }
};

int run(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: engine_gate ADDRESS store|load SEED BLOCKS\n");
    return 2;
  }
  const std::string mode = argv[2];
  const uint64_t seed = std::strtoull(argv[3], nullptr, 10);
  const size_t blocks = std::strtoull(argv[4], nullptr, 10);
  Client cl(argv[1]);
  const auto tokens = prompt(seed, blocks);
  const auto hashes = block_hashes(tokens, blocks);
  // The engine's KV staging buffer, shared with moongate.
  auto* kv = static_cast<unsigned char*>(mg_alloc(cl.c, blocks * kBlockBytes));
  if (!kv) throw std::runtime_error("mg_alloc: " + cl.error());
  std::vector<unsigned char> scratch(blocks * kBlockBytes);
  for (size_t b = 0; b < blocks; b++) compute_block(hashes[b], scratch.data() + b * kBlockBytes);
  const uint64_t from_scratch = output(scratch.data(), blocks, tokens);

  if (mode == "store") {
    std::memcpy(kv, scratch.data(), scratch.size());
    for (size_t b = 0; b < blocks; b++) {
      const std::string k = key_of(seed, hashes[b]);
      const int rc = mg_put(cl.c, k.c_str(), kv + b * kBlockBytes, kBlockBytes);
      if (rc != MG_OK && rc != MG_ERR_EXISTS) throw std::runtime_error("put " + k + ": " + cl.error());
    }
    std::printf("stored %zu blocks\noutput %llu\n", blocks,
                static_cast<unsigned long long>(from_scratch));
    return 0;
  }
  if (mode != "load") throw std::runtime_error("mode " + mode);
  // The scheduler's lookup: how many leading blocks are cached.
  std::vector<std::string> keys;
  std::vector<const char*> kp;
  for (size_t b = 0; b < blocks; b++) keys.push_back(key_of(seed, hashes[b]));
  for (auto& k : keys) kp.push_back(k.c_str());
  std::vector<uint8_t> found(blocks);
  if (mg_exists(cl.c, kp.data(), blocks, found.data()) != MG_OK)
    throw std::runtime_error("exists: " + cl.error());
  size_t hits = 0;
  while (hits < blocks && found[hits]) hits++;
  std::printf("hits %zu/%zu\n", hits, blocks);
  // Load the hit prefix into the registered buffer in one call; compute the rest.
  std::vector<void*> dst(hits);
  std::vector<size_t> caps(hits, kBlockBytes);
  std::vector<int64_t> res(hits);
  for (size_t b = 0; b < hits; b++) dst[b] = kv + b * kBlockBytes;
  if (hits && mg_batch_get_into(cl.c, kp.data(), dst.data(), caps.data(), hits, res.data()) != MG_OK)
    throw std::runtime_error("batch get: " + cl.error());
  for (size_t b = 0; b < hits; b++)
    if (res[b] != static_cast<int64_t>(kBlockBytes))
      throw std::runtime_error("block " + std::to_string(b) + ": " + std::to_string(res[b]));
  for (size_t b = hits; b < blocks; b++) compute_block(hashes[b], kv + b * kBlockBytes);
  if (std::memcmp(kv, scratch.data(), scratch.size()) != 0)
    throw std::runtime_error("loaded blocks differ from the computed ones");
  const uint64_t cached = output(kv, blocks, tokens);
  std::printf("bytes identical\noutput %llu\n", static_cast<unsigned long long>(cached));
  if (cached != from_scratch) throw std::runtime_error("output differs from scratch");
  if (mg_free(cl.c, kv) != MG_OK) throw std::runtime_error("mg_free: " + cl.error());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "engine_gate: %s\n", e.what());
    return 1;
  }
}
