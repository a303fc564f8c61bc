// What handing a lock between cores costs a host, apart from any allocator:
// THREADS threads take one spin lock in turn 2,000,000 times each and, under
// it, write one word on each of LINES cache lines. Prints the mean time per
// critical section; compare 1 thread (no hand-over) with 2 or more, and few
// lines with many (what moving the lines written under the lock adds).
//
//   cc -O2 -pthread -o /tmp/handover benchmarks/host_cost/handover.c
//   /tmp/handover LINES THREADS
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MAX_LINES 64
#define MAX_THREADS 64
#define ITERATIONS 2000000L

static _Alignas(64) atomic_int lock_word;
static _Alignas(64) long lines[MAX_LINES][8];
static int nlines;

static void* run(void* unused) {
  (void)unused;
  for (long i = 0; i < ITERATIONS; i++) {
    int expected = 0;
    while (!atomic_compare_exchange_weak_explicit(&lock_word, &expected, 1, memory_order_acquire,
                                                  memory_order_relaxed)) {
      expected = 0;
      while (atomic_load_explicit(&lock_word, memory_order_relaxed)) {
        __builtin_ia32_pause();
      }
    }
    for (int l = 0; l < nlines; l++) lines[l][0]++;
    atomic_store_explicit(&lock_word, 0, memory_order_release);
  }
  return NULL;
}

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: handover LINES THREADS\n");
    return 2;
  }
  nlines = atoi(argv[1]);
  int threads = atoi(argv[2]);
  if (nlines < 0 || nlines > MAX_LINES || threads < 1 || threads > MAX_THREADS) {
    fprintf(stderr, "handover: LINES in 0..%d, THREADS in 1..%d\n", MAX_LINES, MAX_THREADS);
    return 2;
  }
  pthread_t t[MAX_THREADS];
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int i = 0; i < threads; i++) pthread_create(&t[i], NULL, run, NULL);
  for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
  clock_gettime(CLOCK_MONOTONIC, &b);
  double ns = (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
  printf("lines %d threads %d: %.1f ns per critical section\n", nlines, threads,
         ns / ((double)ITERATIONS * threads));
  return 0;
}
