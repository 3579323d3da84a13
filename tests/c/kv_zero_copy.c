/* Zero-copy views and reservations through the C ABI against a live moongate.
 *
 *   kv_zero_copy check unix:PATH PREFIX   every call and its errors; "all ok" at the end
 *   kv_zero_copy hold unix:PATH PREFIX    holds a view and an uncommitted reservation,
 *                                         says "HELD", and waits to be killed
 *   kv_zero_copy scribble unix:PATH KEY   views KEY, says "VIEWED", writes through the
 *                                         view (the mapping is read-only: this faults)
 *
 * Prints one line per check; exits 1 at the first that does not hold. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "moongate_kv.h"

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

static int same(const unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != (unsigned char)(seed * 31 + i * 7 + (i >> 8))) return 0;
  return 1;
}

static mg_client *connect_or_die(const char *addr) {
  mg_client *c = NULL;
  /* The own segment mounts in the background: the first reservation may find none. */
  for (int i = 0; i < 100 && !c; i++) {
    c = mg_connect(addr);
    if (!c) usleep(100000);
  }
  CHECK(c != NULL, "connect %s: %s", addr, mg_last_error(NULL));
  return c;
}

/* Stores `len` bytes of `seed` under `key` by a reservation; 0 or the code. */
static int reserve_fill_commit(mg_client *c, const char *key, size_t len, unsigned seed) {
  void *p = NULL;
  uint64_t t = 0;
  int rc = mg_reserve(c, key, len, &p, &t);
  if (rc < 0) return rc;
  fill(p, len, seed);
  return mg_commit(c, t);
}

static int check(const char *addr, const char *prefix) {
  mg_client *c = connect_or_die(addr);
  char key[256], k2[256];
  const size_t MiB = 1 << 20;

  /* The mappings, to register with a GPU runtime: read-only then writable, per memory. */
  size_t n = 0;
  CHECK(mg_segments(c, NULL, NULL, 0, &n) == MG_ERR_TOO_SMALL, "cap 0");
  CHECK(n >= 2 && n % 2 == 0, "%zu mappings", n);
  const void *bases[8];
  size_t lens[8];
  CHECK(mg_segments(c, bases, lens, 8, &n) == MG_OK, "segments: %s", mg_last_error(c));
  for (size_t i = 0; i < n; i++) CHECK(bases[i] && lens[i] >= MiB, "mapping %zu", i);
  printf("mappings: %zu (segment %zu bytes)\n", n, lens[0]);

  /* A missing key: not found, no lease. */
  const void *data = NULL;
  size_t len = 0;
  uint64_t lease = 77;
  snprintf(key, sizeof key, "%s/missing", prefix);
  CHECK(mg_view(c, key, &data, &len, &lease) == MG_ERR_NOT_FOUND, "a missing key is viewed");
  CHECK(lease == 77, "a failed view set the lease");
  CHECK(mg_view(c, key, NULL, &len, &lease) == MG_ERR_ARG, "NULL data");

  /* A reservation: invisible until committed, then read in place byte-exact. */
  snprintf(key, sizeof key, "%s/a", prefix);
  void *w = NULL;
  uint64_t t = 0;
  int rc = MG_ERR_NO_ROOM;
  for (int i = 0; i < 100 && rc == MG_ERR_NO_ROOM; i++) {
    rc = mg_reserve(c, key, MiB, &w, &t);
    if (rc == MG_ERR_NO_ROOM) usleep(100000); /* the own segment may still be mounting */
  }
  CHECK(rc == MG_IN_PLACE, "reserve: %d %s", rc, mg_last_error(c));
  fill(w, MiB, 1);
  CHECK(mg_view(c, key, &data, &len, &lease) == MG_ERR_NOT_FOUND, "visible before the commit");
  unsigned char probe;
  uint8_t found = 9;
  const char *ks[2] = {key, NULL};
  CHECK(mg_exists(c, ks, 1, &found) == MG_OK && found == 0, "exists before the commit");
  CHECK(mg_get_into(c, key, &probe, 1) == MG_ERR_NOT_FOUND, "get before the commit");
  CHECK(mg_commit(c, t) == MG_OK, "commit: %s", mg_last_error(c));
  CHECK(mg_commit(c, t) == MG_ERR_NO_LEASE, "committed twice");
  CHECK(mg_abort(c, t) == MG_ERR_NO_LEASE, "aborted after the commit");
  rc = mg_view(c, key, &data, &len, &lease);
  CHECK(rc == MG_IN_PLACE, "view: %d %s", rc, mg_last_error(c));
  CHECK(len == MiB && same(data, len, 1), "viewed bytes");
  CHECK(lease != 0, "no lease");
  /* The copying path reads the same bytes. */
  unsigned char *copy = malloc(MiB);
  CHECK(mg_get_into(c, key, copy, MiB) == (int64_t)MiB && same(copy, MiB, 1), "get_into");
  /* A reader's lease: an unforced removal is refused while the view is held. */
  CHECK(mg_remove(c, key) == MG_ERR_LEASED, "removed under a view: %s", mg_last_error(c));
  CHECK(mg_release(c, lease) == MG_OK, "release: %s", mg_last_error(c));
  CHECK(mg_release(c, lease) == MG_ERR_NO_LEASE, "released twice");
  CHECK(strstr(mg_last_error(c), "no lease") != NULL || strlen(mg_last_error(c)) > 0, "message");
  CHECK(mg_release(c, 0) == MG_OK, "lease 0");
  printf("reserve, commit, view, release: ok\n");

  /* Aborted: nothing visible, and the key can be reserved again. */
  snprintf(k2, sizeof k2, "%s/b", prefix);
  CHECK(mg_reserve(c, k2, 4096, &w, &t) == MG_IN_PLACE, "reserve b: %s", mg_last_error(c));
  memset(w, 0xab, 4096);
  CHECK(mg_abort(c, t) == MG_OK, "abort: %s", mg_last_error(c));
  CHECK(mg_commit(c, t) == MG_ERR_NO_LEASE, "commit after abort");
  CHECK(mg_view(c, k2, &data, &len, &lease) == MG_ERR_NOT_FOUND, "an aborted value is visible");
  CHECK(reserve_fill_commit(c, k2, 4096, 2) == MG_OK, "b again: %s", mg_last_error(c));
  printf("abort: ok\n");

  /* Refusals. */
  CHECK(mg_reserve(c, key, MiB, &w, &t) == MG_ERR_EXISTS, "reserved an existing key");
  CHECK(mg_reserve(c, "x/huge", (size_t)1 << 40, &w, &t) == MG_ERR_ARG, "over max_value_bytes");
  CHECK(strstr(mg_last_error(c), "kv.max_value_bytes") != NULL, "message: %s", mg_last_error(c));
  CHECK(mg_reserve(c, "x/zero", 0, &w, &t) == MG_ERR_ARG, "0 bytes");
  CHECK(mg_reserve(c, NULL, 1, &w, &t) == MG_ERR_ARG, "NULL key");
  CHECK(mg_commit(c, 123456789) == MG_ERR_NO_LEASE, "an unknown ticket");
  printf("refusals: ok\n");

  /* Batches: one reservation call and one commit for 8 values, one view for 9 keys. */
  enum { B = 8 };
  char names[B + 1][64];
  const char *bk[B + 1];
  size_t bl[B];
  void *bd[B];
  uint64_t bt[B];
  int br[B + 1];
  for (int i = 0; i <= B; i++) {
    snprintf(names[i], sizeof names[i], "%s/batch/%d", prefix, i);
    bk[i] = names[i];
    if (i < B) bl[i] = 65536 + (size_t)i * 4096;
  }
  CHECK(mg_batch_reserve(c, bk, bl, B, bd, bt, br) == MG_OK, "batch reserve: %s", mg_last_error(c));
  for (int i = 0; i < B; i++) {
    CHECK(br[i] == MG_IN_PLACE, "item %d: %d", i, br[i]);
    fill(bd[i], bl[i], 10 + i);
  }
  CHECK(mg_batch_commit(c, bt, B, br) == MG_OK, "batch commit");
  for (int i = 0; i < B; i++) CHECK(br[i] == MG_OK, "commit item %d: %d", i, br[i]);
  const void *vd[B + 1];
  size_t vl[B + 1];
  CHECK(mg_batch_view(c, bk, B + 1, vd, vl, br, &lease) == MG_OK, "batch view");
  CHECK(lease != 0, "batch lease");
  for (int i = 0; i < B; i++)
    CHECK(br[i] == MG_IN_PLACE && vl[i] == bl[i] && same(vd[i], vl[i], 10 + i), "item %d", i);
  CHECK(br[B] == MG_ERR_NOT_FOUND, "the missing item: %d", br[B]);
  CHECK(mg_release(c, lease) == MG_OK, "batch release");
  CHECK(mg_batch_view(c, bk + B, 1, vd, vl, br, &lease) == MG_OK && lease == 0, "nothing held");
  printf("batches: ok\n");

  /* Another handle holds none of this one's leases or tickets. */
  mg_client *other = connect_or_die(addr);
  snprintf(k2, sizeof k2, "%s/c", prefix);
  CHECK(mg_reserve(c, k2, 4096, &w, &t) == MG_IN_PLACE, "reserve c");
  CHECK(mg_view(c, key, &data, &len, &lease) == MG_IN_PLACE, "view a");
  CHECK(mg_commit(other, t) == MG_ERR_NO_LEASE, "another handle committed the ticket");
  CHECK(mg_abort(other, t) == MG_ERR_NO_LEASE, "another handle aborted the ticket");
  CHECK(mg_release(other, lease) == MG_ERR_NO_LEASE, "another handle released the lease");
  fill(w, 4096, 3);
  CHECK(mg_commit(c, t) == MG_OK, "commit c");
  CHECK(mg_release(c, lease) == MG_OK, "release a");
  mg_close(other);
  printf("another handle: ok\n");

  /* Threads of one handle share its leases (each call takes its own connection). */
  CHECK(mg_view(c, key, &data, &len, &lease) == MG_IN_PLACE, "view for threads");
  free(copy);
  mg_close(c);
  printf("all ok\n");
  return 0;
}

int main(int argc, char **argv) {
  CHECK(argc == 4, "usage: kv_zero_copy check|hold|scribble unix:PATH PREFIX|KEY");
  const char *mode = argv[1], *addr = argv[2], *arg = argv[3];
  if (strcmp(mode, "check") == 0) return check(addr, arg);
  mg_client *c = connect_or_die(addr);
  char key[256];
  const void *data;
  size_t len;
  uint64_t lease;
  if (strcmp(mode, "hold") == 0) {
    snprintf(key, sizeof key, "%s/viewed", arg);
    CHECK(reserve_fill_commit(c, key, 1 << 20, 5) == MG_OK, "store: %s", mg_last_error(c));
    CHECK(mg_view(c, key, &data, &len, &lease) == MG_IN_PLACE, "view: %s", mg_last_error(c));
    snprintf(key, sizeof key, "%s/unfinished", arg);
    void *w;
    uint64_t t;
    CHECK(mg_reserve(c, key, 1 << 20, &w, &t) == MG_IN_PLACE, "reserve: %s", mg_last_error(c));
    fill(w, 1 << 19, 6); /* half written when the engine dies */
    printf("HELD %llu %llu\n", (unsigned long long)lease, (unsigned long long)t);
    fflush(stdout);
    for (;;) pause();
  }
  if (strcmp(mode, "scribble") == 0) {
    int rc = mg_view(c, arg, &data, &len, &lease);
    CHECK(rc == MG_IN_PLACE, "view %s: %d %s", arg, rc, mg_last_error(c));
    printf("VIEWED %zu\n", len);
    fflush(stdout);
    ((volatile unsigned char *)data)[len / 2] = 0x5a;
    printf("WROTE\n");
    return 0;
  }
  CHECK(0, "unknown mode %s", mode);
  return 1;
}
