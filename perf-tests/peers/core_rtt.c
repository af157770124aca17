/* core_rtt.c -- cache-line round trip between two CPUs, in ns: how far apart the host placed them.
 *
 *     core_rtt [-c A,B] [-i SECONDS] [-k BATCHES] [-r ROUNDTRIPS]
 *
 * A thread on CPU A and one on CPU B bounce one cache line; a sample is the fastest of
 * BATCHES batches of ROUNDTRIPS round trips (ns per round trip), so a thread preempted for a
 * while spoils a batch, not the sample. On a VM the hypervisor may move vCPUs between cores
 * that share an L3 and cores that do not: the round trip then jumps (e.g. 60-90 ns vs
 * 330-380 ns on a 2-vCPU AMD EPYC), and with it every cross-core transfer -- shared memory,
 * loopback TCP -- for any library. perf-tests/compare samples this during every run.
 *
 *   -c A,B   the two CPUs                       [the first two this process may run on]
 *   -i S     0: one sample, print "NS", exit; > 0: every S seconds print "UNIX_TIME NS"
 *            (line-buffered) until SIGTERM/SIGINT                                    [0]
 *   -k, -r   batches per sample, round trips per batch                        [8, 100]
 *
 * Cost per sample: BATCHES x ROUNDTRIPS round trips on both CPUs (about 0.05-0.3 ms); at
 * -i 0.5 that is well under 0.1% of the machine. Exit 2 on bad arguments or < 2 CPUs.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static _Alignas(64) atomic_long line;  /* the bounced cache line: odd = ping, even = pong */
static _Alignas(64) atomic_int pong_ready;
static int cpu_a = -1, cpu_b = -1, batches = 8, trips = 100;
static volatile sig_atomic_t stop;

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

static int pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    return pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}

/* Waits until `line` holds `want`; gives up after 100 ms (the other thread is not running). */
static int await(long want) {
    double t0 = 0;
    for (unsigned spins = 1;; spins++) {
        if (atomic_load_explicit(&line, memory_order_acquire) == want) return 1;
        if ((spins & 1023) == 0) {
            if (t0 == 0) t0 = now_ns();
            else if (now_ns() - t0 > 100e6) return 0;
        }
    }
}

static void *pong(void *arg) {
    (void)arg;
    pin(cpu_b);
    atomic_store(&pong_ready, 1);
    long total = (long)batches * trips;
    for (long i = 0; i < total; i++) {
        if (!await(2 * i + 1)) return NULL;
        atomic_store_explicit(&line, 2 * i + 2, memory_order_release);
    }
    return NULL;
}

/* One sample: ns per round trip, fastest batch; -1 when no batch completed. */
static double sample(void) {
    pthread_t t;
    atomic_store(&line, 0);
    atomic_store(&pong_ready, 0);
    if (pthread_create(&t, NULL, pong, NULL) != 0) return -1;
    double best = -1, t0 = now_ns();
    while (!atomic_load(&pong_ready) && now_ns() - t0 < 100e6) {
    }
    long i = 0;
    for (int b = 0; b < batches && atomic_load(&pong_ready); b++) {
        double s = now_ns();
        int ok = 1;
        for (int k = 0; k < trips && ok; k++, i++) {
            atomic_store_explicit(&line, 2 * i + 1, memory_order_release);
            ok = await(2 * i + 2);
        }
        if (!ok) break;
        double per = (now_ns() - s) / trips;
        if (best < 0 || per < best) best = per;
    }
    /* Release a pong thread that is still waiting: it gives up by itself after 100 ms. */
    pthread_join(t, NULL);
    return best;
}

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

static int usage(const char *why) {
    fprintf(stderr, "core_rtt: %s\nusage: core_rtt [-c A,B] [-i SECONDS] [-k BATCHES] [-r ROUNDTRIPS]\n", why);
    return 2;
}

int main(int argc, char **argv) {
    double interval = 0;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "-c") && v) {
            if (sscanf(v, "%d,%d", &cpu_a, &cpu_b) != 2 || cpu_a < 0 || cpu_b < 0 || cpu_a == cpu_b)
                return usage("-c wants two different CPU numbers, e.g. -c 0,1");
        } else if (!strcmp(argv[i], "-i") && v) {
            interval = atof(v);
            if (interval < 0) return usage("-i wants seconds >= 0");
        } else if (!strcmp(argv[i], "-k") && v) {
            batches = atoi(v);
            if (batches < 1) return usage("-k wants a count >= 1");
        } else if (!strcmp(argv[i], "-r") && v) {
            trips = atoi(v);
            if (trips < 1) return usage("-r wants a count >= 1");
        } else {
            return usage(v ? "unknown argument" : "missing value");
        }
        i++;
    }
    if (cpu_a < 0) {
        cpu_set_t s;
        if (sched_getaffinity(0, sizeof s, &s) != 0) return usage("cannot read the CPU affinity");
        for (int c = 0; c < CPU_SETSIZE && cpu_b < 0; c++)
            if (CPU_ISSET(c, &s)) {
                if (cpu_a < 0) cpu_a = c;
                else cpu_b = c;
            }
        if (cpu_b < 0) return usage("needs two CPUs, this process may run on one");
    }
    if (pin(cpu_a) != 0) return usage("cannot run on CPU A (-c)");
    if (interval == 0) {
        double ns = sample();
        if (ns < 0) return usage("the two threads never ran together (is CPU B usable?)");
        printf("%.0f\n", ns);
        return 0;
    }
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    setvbuf(stdout, NULL, _IOLBF, 0);
    while (!stop) {
        double ns = sample();
        struct timespec wall;
        clock_gettime(CLOCK_REALTIME, &wall);
        if (ns >= 0) printf("%.3f %.0f\n", wall.tv_sec + wall.tv_nsec / 1e9, ns);
        struct timespec d = {(time_t)interval, (long)((interval - (time_t)interval) * 1e9)};
        nanosleep(&d, NULL);
    }
    return 0;
}
