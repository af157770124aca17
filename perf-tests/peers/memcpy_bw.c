/*
 * memcpy_bw.c -- memcpy bandwidth, the machine's copy limit beside qccl's bus bandwidth.
 *
 * Build:  gcc -O2 -pthread -o memcpy_bw memcpy_bw.c
 * Run:    ./memcpy_bw [-s 64M,256M] [-t 1,2] [-p passes] [-J out.json]
 *
 * For each size S and thread count T: src and dst buffers of S bytes, touched first
 * (so page faults are not timed); each pass copies all S bytes (T threads copy S/T each,
 * started together at a barrier, a pass ends when the last thread finishes); the best
 * of `passes` passes is reported (after one untimed pass).
 * COUNTED: GB/s = S / best pass time / 1e9, i.e. bytes copied per second. The memory
 * traffic is at least twice that (S read + S written; three times with write-allocate).
 *
 * JSON (-J): [{"what": "memcpy", "size": S, "threads": T, "passes": P, "best_us": ..,
 *              "median_us": .., "GBps": .., "counted": "bytes copied (size) / time"}, ...]
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    size_t mul = 1;
    if (*end == 'k' || *end == 'K') mul = 1ULL << 10;
    else if (*end == 'm' || *end == 'M') mul = 1ULL << 20;
    else if (*end == 'g' || *end == 'G') mul = 1ULL << 30;
    return (size_t)(v * (double)mul);
}

struct job {
    char *dst, *src;
    size_t len;
    int passes;
    pthread_barrier_t *start, *end;
    double *t0, *t1; /* per pass: this thread's start and end times */
};

static void *copier(void *p) {
    struct job *j = p;
    for (int i = 0; i < j->passes; i++) {
        pthread_barrier_wait(j->start);
        j->t0[i] = now();
        memcpy(j->dst, j->src, j->len);
        j->t1[i] = now();
        pthread_barrier_wait(j->end);
    }
    return NULL;
}

static int cmpd(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    const char *sizes = "64M,256M", *threads = "1,2", *json = NULL;
    int passes = 0;
    int opt;
    while ((opt = getopt(argc, argv, "s:t:p:J:h")) != -1) {
        switch (opt) {
        case 's': sizes = optarg; break;
        case 't': threads = optarg; break;
        case 'p': passes = atoi(optarg); break;
        case 'J': json = optarg; break;
        default:
            fprintf(stderr, "usage: memcpy_bw [-s 64M,256M] [-t 1,2] [-p passes] [-J out.json]\n");
            return opt == 'h' ? 0 : 2;
        }
    }
    FILE *jf = NULL;
    if (json && !(jf = fopen(json, "w"))) { perror(json); return 1; }
    if (jf) fprintf(jf, "[");
    printf("# memcpy_bw: counted = bytes copied (the copy size) / best pass time, GB = 1e9 B;"
           " memory traffic is >= 2x that (read + write)\n");
    printf("#%11s  %7s  %6s  %10s  %10s  %8s\n", "size(B)", "threads", "passes", "best(us)",
           "median(us)", "GB/s");
    int first = 1;
    char *sl = strdup(sizes), *ss, *sp1;
    for (ss = strtok_r(sl, ",", &sp1); ss; ss = strtok_r(NULL, ",", &sp1)) {
        size_t S = parse_size(ss);
        char *src = aligned_alloc(4096, (S + 4095) / 4096 * 4096);
        char *dst = aligned_alloc(4096, (S + 4095) / 4096 * 4096);
        if (!src || !dst) { fprintf(stderr, "out of memory for %zu\n", S); return 1; }
        memset(src, 1, S);
        memset(dst, 0, S);
        char *tl = strdup(threads), *ts, *sp2;
        for (ts = strtok_r(tl, ",", &sp2); ts; ts = strtok_r(NULL, ",", &sp2)) {
            int T = atoi(ts);
            if (T < 1) continue;
            if (T > 64) T = 64;
            int P = passes > 0 ? passes : (S <= (64u << 20) ? 30 : 12);
            pthread_barrier_t b0, b1;
            pthread_barrier_init(&b0, NULL, T + 1);
            pthread_barrier_init(&b1, NULL, T + 1);
            pthread_t th[64];
            struct job jobs[64];
            size_t chunk = (S / T + 63) / 64 * 64;
            double *st = calloc((size_t)T * (P + 1), sizeof *st), *en = calloc((size_t)T * (P + 1), sizeof *en);
            for (int t = 0; t < T; t++) {
                size_t off = chunk * t < S ? chunk * t : S;
                size_t len = off + chunk <= S ? chunk : S - off;
                jobs[t] = (struct job){dst + off, src + off, len, P + 1, &b0, &b1, st + t * (P + 1),
                                      en + t * (P + 1)};
                pthread_create(&th[t], NULL, copier, &jobs[t]);
            }
            double *tm = calloc(P, sizeof *tm);
            for (int i = 0; i <= P; i++) {
                pthread_barrier_wait(&b0);
                pthread_barrier_wait(&b1);
            }
            for (int t = 0; t < T; t++) pthread_join(th[t], NULL);
            /* a pass lasts from the first thread's start to the last thread's end;
               pass 0 is untimed */
            for (int i = 1; i <= P; i++) {
                double a = st[i], z = en[i];
                for (int t = 1; t < T; t++) {
                    if (st[t * (P + 1) + i] < a) a = st[t * (P + 1) + i];
                    if (en[t * (P + 1) + i] > z) z = en[t * (P + 1) + i];
                }
                tm[i - 1] = z - a;
            }
            free(st);
            free(en);
            pthread_barrier_destroy(&b0);
            pthread_barrier_destroy(&b1);
            qsort(tm, P, sizeof *tm, cmpd);
            double best = tm[0], med = tm[P / 2], gbps = (double)S / best / 1e9;
            printf("%12zu  %7d  %6d  %10.1f  %10.1f  %8.2f\n", S, T, P, best * 1e6, med * 1e6, gbps);
            fflush(stdout);
            if (jf)
                fprintf(jf, "%s\n {\"what\": \"memcpy\", \"size\": %zu, \"threads\": %d, \"passes\": %d, "
                            "\"best_us\": %.1f, \"median_us\": %.1f, \"GBps\": %.3f, "
                            "\"counted\": \"bytes copied (size) / best pass time\"}",
                        first ? "" : ",", S, T, P, best * 1e6, med * 1e6, gbps);
            first = 0;
            free(tm);
        }
        free(tl);
        free(src);
        free(dst);
    }
    free(sl);
    if (jf) { fprintf(jf, "\n]\n"); fclose(jf); }
    return 0;
}
