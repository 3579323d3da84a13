/* The C ABI against a live moongate: every call, its errors, and one handle shared by
 * threads. Usage: kv_abi ADDRESS PREFIX (ADDRESS as mg_connect takes it), or
 * kv_abi quic:HOST:PORT PREFIX SHA256 CERT KEY (mg_connect_quic with a client
 * certificate, to a moongate that requires one). Prints one line per check; exits 0
 * when all hold, 1 at the first that does not. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moongate_kv.h"

static int failed = 0;

#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      fprintf(stderr, __VA_ARGS__);                        \
      fprintf(stderr, "\n");                               \
      exit(1);                                             \
    }                                                      \
  } while (0)

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(seed * 31 + i * 7 + (i >> 8));
}

struct job {
  mg_client *c;
  const char *prefix;
  int id;
};

/* Each thread puts and reads back its own keys through the shared handle. */
static void *worker(void *arg) {
  struct job *j = arg;
  unsigned char val[4096], got[4096];
  char key[256];
  for (int i = 0; i < 20; i++) {
    snprintf(key, sizeof key, "%s/t%d/%d", j->prefix, j->id, i);
    fill(val, sizeof val, (unsigned)(j->id * 100 + i));
    int rc = mg_put(j->c, key, val, sizeof val);
    if (rc != MG_OK) {
      fprintf(stderr, "thread %d put %s: %d %s\n", j->id, key, rc, mg_last_error(j->c));
      return (void *)1;
    }
    int64_t n = mg_get_into(j->c, key, got, sizeof got);
    if (n != (int64_t)sizeof val || memcmp(val, got, sizeof val) != 0) {
      fprintf(stderr, "thread %d get %s: %lld %s\n", j->id, key, (long long)n,
              mg_last_error(j->c));
      return (void *)1;
    }
  }
  return NULL;
}

int main(int argc, char **argv) {
  int quic = argc == 6 && strncmp(argv[1], "quic:", 5) == 0;
  CHECK(argc == 3 || quic, "usage: kv_abi ADDRESS PREFIX | kv_abi quic:HOST:PORT PREFIX SHA256 CERT KEY");
  const char *addr = argv[1], *prefix = argv[2];
  char key[256], key2[256], key3[256];

  /* Bad addresses: NULL and a message, never a crash. */
  CHECK(mg_connect("nonsense") == NULL, "a bad address connects");
  CHECK(strstr(mg_last_error(NULL), "unix:PATH") != NULL, "message: %s", mg_last_error(NULL));
  CHECK(mg_connect("tcp:127.0.0.1:1") == NULL, "a closed port connects");
  CHECK(mg_connect(NULL) == NULL, "NULL connects");
  printf("bad addresses refused: %s\n", mg_last_error(NULL));

  mg_client *c;
  if (quic) {
    const char *hostport = addr + 5, *sha = argv[3], *cert = argv[4], *key = argv[5];
    /* QUIC's bad arguments: each refused with its reason, before or at the handshake. */
    CHECK(mg_connect(addr) == NULL, "mg_connect takes quic:");
    CHECK(strstr(mg_last_error(NULL), "mg_connect_quic") != NULL, "message: %s", mg_last_error(NULL));
    CHECK(mg_connect_quic(hostport, "abc", cert, key) == NULL, "a short fingerprint");
    CHECK(strstr(mg_last_error(NULL), "64 hex") != NULL, "message: %s", mg_last_error(NULL));
    CHECK(mg_connect_quic(hostport, sha, cert, NULL) == NULL, "a certificate without its key");
    CHECK(mg_connect_quic(hostport, sha, "/nonexistent.pem", key) == NULL, "a missing certificate file");
    CHECK(strstr(mg_last_error(NULL), "/nonexistent.pem") != NULL, "message: %s", mg_last_error(NULL));
    char wrong[65];
    memcpy(wrong, sha, 64);
    wrong[64] = 0;
    wrong[0] = wrong[0] == '0' ? '1' : '0';
    CHECK(mg_connect_quic(hostport, wrong, cert, key) == NULL, "another fingerprint connects");
    CHECK(strstr(mg_last_error(NULL), "pinned") != NULL, "message: %s", mg_last_error(NULL));
    /* Without a certificate: refused at the handshake or at the first call (TLS 1.3
     * reports a refused client certificate after the client's side is done). */
    printf("quic arguments refused: %s\n", mg_last_error(NULL));
    mg_client *anon = mg_connect_quic(hostport, sha, NULL, NULL);
    if (anon != NULL) {
      CHECK(mg_put(anon, "anon/x", "x", 1) < 0, "a caller without a certificate stored a value");
      printf("no client certificate: refused at the first call: %s\n", mg_last_error(anon));
      mg_close(anon);
    } else {
      printf("no client certificate: refused at connect: %s\n", mg_last_error(NULL));
    }
    c = mg_connect_quic(hostport, sha, cert, key);
  } else {
    c = mg_connect(addr);
  }
  CHECK(c != NULL, "connect %s: %s", addr, mg_last_error(NULL));
  CHECK(strcmp(mg_last_error(c), "") == 0, "a fresh handle has no error");

  /* put / get_into, 2 MiB + 5 bytes, byte-exact. */
  size_t big = (2u << 20) + 5;
  unsigned char *val = malloc(big), *got = malloc(big);
  fill(val, big, 1);
  snprintf(key, sizeof key, "%s/big", prefix);
  CHECK(mg_put(c, key, val, big) == MG_OK, "put: %s", mg_last_error(c));
  memset(got, 0, big);
  CHECK(mg_get_into(c, key, got, big) == (int64_t)big, "get_into: %s", mg_last_error(c));
  CHECK(memcmp(val, got, big) == 0, "bytes differ");
  printf("2 MiB + 5 round trip: ok\n");

  /* Too small: an error with the length, and the handle still works. */
  CHECK(mg_get_into(c, key, got, 10) == MG_ERR_TOO_SMALL, "too small");
  CHECK(strstr(mg_last_error(c), "2097157") != NULL, "message: %s", mg_last_error(c));
  CHECK(mg_get_into(c, key, got, big) == (int64_t)big, "after too small: %s", mg_last_error(c));
  printf("too small: %s\n", mg_last_error(c));

  /* Absent key, existing key, empty value, NULLs. */
  snprintf(key2, sizeof key2, "%s/absent", prefix);
  CHECK(mg_get_into(c, key2, got, big) == MG_ERR_NOT_FOUND, "absent");
  CHECK(mg_put(c, key, val, 16) == MG_ERR_EXISTS, "exists: %s", mg_last_error(c));
  CHECK(mg_put(c, key2, val, 0) == MG_ERR_REFUSED, "empty value: %s", mg_last_error(c));
  CHECK(mg_put(c, NULL, val, 4) == MG_ERR_ARG, "NULL key");
  CHECK(mg_put(c, key2, NULL, 4) == MG_ERR_ARG, "NULL data");
  CHECK(mg_get_into(NULL, key, got, big) == MG_ERR_ARG, "NULL handle");
  CHECK(mg_get_into(c, key, NULL, 4) == MG_ERR_ARG, "NULL buffer");
  CHECK(mg_put(c, "\xff\xfe", val, 4) == MG_ERR_ARG, "not UTF-8");
  printf("errors: ok (%s)\n", mg_last_error(c));

  /* exists, remove. */
  const char *keys[3] = {key, key2, key};
  uint8_t found[3] = {9, 9, 9};
  CHECK(mg_exists(c, keys, 3, found) == MG_OK, "exists: %s", mg_last_error(c));
  CHECK(found[0] == 1 && found[1] == 0 && found[2] == 1, "found %d %d %d", found[0], found[1],
        found[2]);
  CHECK(mg_remove(c, key2) == MG_ERR_NOT_FOUND, "remove absent");
  /* A stored key removed (204, no body), then absent; the handle goes on. */
  CHECK(mg_put(c, key2, "gone", 4) == MG_OK, "put to remove: %s", mg_last_error(c));
  CHECK(mg_remove(c, key2) == MG_OK, "remove: %s", mg_last_error(c));
  CHECK(mg_get_into(c, key2, got, big) == MG_ERR_NOT_FOUND, "removed key still read");
  CHECK(mg_remove(c, key2) == MG_ERR_NOT_FOUND, "remove twice");

  /* Batches: put three (one already stored), get three (one absent, one too small). */
  snprintf(key2, sizeof key2, "%s/b1", prefix);
  snprintf(key3, sizeof key3, "%s/b2", prefix);
  const char *bkeys[3] = {key2, key, key3};
  const void *bdata[3] = {"one", "dup", "two!"};
  size_t blens[3] = {3, 3, 4};
  int bres[3] = {1, 1, 1};
  CHECK(mg_batch_put(c, bkeys, bdata, blens, 3, bres) == MG_OK, "batch put: %s",
        mg_last_error(c));
  CHECK(bres[0] == MG_OK && bres[1] == MG_ERR_EXISTS && bres[2] == MG_OK, "batch put %d %d %d",
        bres[0], bres[1], bres[2]);
  char b0[8], b2[2];
  snprintf(key, sizeof key, "%s/none", prefix);
  const char *gkeys[3] = {key2, key, key3};
  void *gdst[3] = {b0, got, b2};
  size_t gcaps[3] = {sizeof b0, big, sizeof b2};
  int64_t gres[3] = {0, 0, 0};
  CHECK(mg_batch_get_into(c, gkeys, gdst, gcaps, 3, gres) == MG_OK, "batch get: %s",
        mg_last_error(c));
  CHECK(gres[0] == 3 && memcmp(b0, "one", 3) == 0, "batch get 0: %lld", (long long)gres[0]);
  CHECK(gres[1] == MG_ERR_NOT_FOUND && gres[2] == MG_ERR_TOO_SMALL, "batch get %lld %lld",
        (long long)gres[1], (long long)gres[2]);
  /* Empty batches: NULL arrays are allowed with n = 0, and nothing happens. */
  CHECK(mg_batch_put(c, NULL, NULL, NULL, 0, NULL) == MG_OK, "empty batch put: %s",
        mg_last_error(c));
  CHECK(mg_batch_get_into(c, NULL, NULL, NULL, 0, NULL) == MG_OK, "empty batch get: %s",
        mg_last_error(c));
  printf("batches: ok\n");

  /* mg_alloc memory works as any buffer; a foreign pointer is refused. */
  unsigned char *shared = mg_alloc(c, 1 << 20);
  CHECK(shared != NULL, "mg_alloc: %s", mg_last_error(c));
  fill(shared, 1 << 20, 7);
  snprintf(key, sizeof key, "%s/shared", prefix);
  CHECK(mg_put(c, key, shared, 1 << 20) == MG_OK, "put from shared: %s", mg_last_error(c));
  memset(shared, 0, 1 << 20);
  CHECK(mg_get_into(c, key, shared, 1 << 20) == (1 << 20), "get into shared: %s",
        mg_last_error(c));
  fill(got, 1 << 20, 7);
  CHECK(memcmp(shared, got, 1 << 20) == 0, "shared bytes differ");
  /* A batch read into one shared buffer, at offsets of the caller's choosing. */
  snprintf(key2, sizeof key2, "%s/b1", prefix);
  snprintf(key3, sizeof key3, "%s/b2", prefix);
  const char *skeys[3] = {key, key2, key3};
  void *sdst[3] = {shared, shared + (1 << 19), shared + (1 << 19) + 4096};
  size_t scaps[3] = {1 << 19, 4096, 4096};
  int64_t sres[3] = {0, 0, 0};
  CHECK(mg_batch_get_into(c, skeys, sdst, scaps, 3, sres) == MG_OK, "batch into shared: %s",
        mg_last_error(c));
  CHECK(sres[0] == MG_ERR_TOO_SMALL && sres[1] == 3 && sres[2] == 4, "batch into shared %lld %lld %lld",
        (long long)sres[0], (long long)sres[1], (long long)sres[2]);
  CHECK(memcmp(sdst[1], "one", 3) == 0 && memcmp(sdst[2], "two!", 4) == 0, "batch shared bytes");
  /* A batch put from one shared buffer (moongate reads the values there); the value
     already stored under `key` is refused as it is over HTTP. */
  snprintf(key2, sizeof key2, "%s/s1", prefix);
  snprintf(key3, sizeof key3, "%s/s2", prefix);
  memcpy(shared + 8192, "shared-one", 10);
  memcpy(shared + 16384, "shared-two", 10);
  const char *pkeys[3] = {key2, key, key3};
  const void *pdata[3] = {shared + 8192, shared, shared + 16384};
  size_t plens[3] = {10, 4096, 10};
  int pres[3] = {1, 1, 1};
  CHECK(mg_batch_put(c, pkeys, pdata, plens, 3, pres) == MG_OK, "batch put from shared: %s",
        mg_last_error(c));
  CHECK(pres[0] == MG_OK && pres[1] == MG_ERR_EXISTS && pres[2] == MG_OK,
        "batch put from shared %d %d %d", pres[0], pres[1], pres[2]);
  char s1[16], s2[16];
  CHECK(mg_get_into(c, key2, s1, sizeof s1) == 10 && memcmp(s1, "shared-one", 10) == 0,
        "batch put from shared: first value");
  CHECK(mg_get_into(c, key3, s2, sizeof s2) == 10 && memcmp(s2, "shared-two", 10) == 0,
        "batch put from shared: third value");
  CHECK(mg_free(c, got) == MG_ERR_ARG, "freeing malloc'd memory");
  CHECK(mg_free(c, shared) == MG_OK, "mg_free: %s", mg_last_error(c));
  CHECK(mg_free(c, shared) == MG_ERR_ARG, "double free refused");
  CHECK(mg_alloc(c, 0) == NULL, "mg_alloc(0)");
  (void)mg_alloc(c, 4096); /* left to mg_close */
  printf("mg_alloc: ok\n");

  /* Eight threads on one handle. */
  pthread_t th[8];
  struct job jobs[8];
  for (int i = 0; i < 8; i++) {
    jobs[i] = (struct job){c, prefix, i};
    CHECK(pthread_create(&th[i], NULL, worker, &jobs[i]) == 0, "pthread_create");
  }
  for (int i = 0; i < 8; i++) {
    void *r;
    pthread_join(th[i], &r);
    if (r != NULL) failed = 1;
  }
  CHECK(!failed, "a thread failed");
  printf("8 threads x 20 round trips on one handle: ok\n");

  snprintf(key, sizeof key, "%s/t0/0", prefix);
  int rc = mg_remove(c, key);
  CHECK(rc == MG_OK || rc == MG_ERR_LEASED, "remove: %d %s", rc, mg_last_error(c));
  printf("remove: %d\n", rc);

  mg_close(c);
  mg_close(NULL);
  free(val);
  free(got);
  printf("all ok\n");
  return 0;
}
