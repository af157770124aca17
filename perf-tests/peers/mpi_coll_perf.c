/*
 * mpi_coll_perf.c -- an MPI collective benchmark whose output mirrors
 * nccl-tests' all_reduce_perf, used as a peer for qccl (perf-tests/compare).
 *
 * Build:  mpicc -O2 -o mpi_coll_perf mpi_coll_perf.c
 *         (Debian: mpicc.openmpi for Open MPI, mpicc.mpich -o mpi_coll_perf.mpich for MPICH)
 * Run:    mpirun -np 2 ./mpi_coll_perf -b 4K -e 256M -f 2 -n 1000 -w 5 -T 0.3 -J out.json
 *
 * Flags (nccl-tests names where they exist):
 *   -b SIZE   min size in bytes (K/M/G suffixes, powers of 1024)       [32M]
 *   -e SIZE   max size in bytes                                        [32M]
 *   -f N      multiplication factor between sizes                      [2]
 *   -n N      timed iterations per size (an upper bound when -T > 0)   [20]
 *   -w N      warmup iterations per size (at least)                    [5]
 *   -d TYPE   float | double                                           [float]
 *   -C COLL   allreduce | reduce_scatter | allgather | bcast           [allreduce]
 *   -T SECS   target seconds of timed iterations per size: iters =
 *             clamp(SECS / estimated iteration time, 3, n); 0 = exactly n   [0]
 *   -J FILE   write results as JSON (rank 0; flushed after every size, so a run killed
 *             part way leaves the sizes it measured, without the closing "]")
 *   -h        help
 *
 * Method, as nccl-tests: "size" is the total bytes of the collective (for allreduce the
 * buffer size; for reduce_scatter the send buffer of one rank, for allgather the receive
 * buffer of one rank); a timed run is MPI_Barrier, then `iters` back-to-back calls,
 * time = elapsed / iters, averaged over the ranks. algbw = size / time, busbw = algbw *
 * factor, factor = 2(n-1)/n allreduce, (n-1)/n reduce_scatter and allgather, 1 bcast.
 * GB = 1e9 bytes. Out-of-place buffers (bcast is in place). #wrong counts mismatches in a
 * sample of the result after the timed loop (summed over ranks).
 *
 * JSON (-J): a list, one object per size:
 *   [{"size": 4096, "count": 1024, "type": "float", "redop": "sum", "coll": "allreduce",
 *     "nranks": 2, "iters": 1000, "time_us": 12.3, "algbw": 0.33, "busbw": 0.33,
 *     "wrong": 0}, ...]
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>
#include <math.h>

enum coll { C_ALLREDUCE, C_REDUCE_SCATTER, C_ALLGATHER, C_BCAST };
static const char *coll_names[] = {"allreduce", "reduce_scatter", "allgather", "bcast"};

static size_t parse_size(const char *s) {
    char *end;
    double v = strtod(s, &end);
    size_t mul = 1;
    switch (*end) {
    case 'k': case 'K': mul = 1024ULL; break;
    case 'm': case 'M': mul = 1024ULL * 1024; break;
    case 'g': case 'G': mul = 1024ULL * 1024 * 1024; break;
    case '\0': break;
    default: fprintf(stderr, "bad size '%s'\n", s); exit(2);
    }
    return (size_t)(v * (double)mul);
}

/* small integers: sums are exact in float for any sane rank count */
static inline double val(int r, size_t i) { return (double)((r * 3 + (long)(i % 1000003)) % 11); }

static void fill(void *buf, size_t n, int isdbl, int r, size_t off) {
    if (isdbl) { double *p = buf; for (size_t i = 0; i < n; i++) p[i] = val(r, off + i); }
    else { float *p = buf; for (size_t i = 0; i < n; i++) p[i] = (float)val(r, off + i); }
}
static inline double get(const void *buf, size_t i, int isdbl) {
    return isdbl ? ((const double *)buf)[i] : (double)((const float *)buf)[i];
}

static void run_coll(enum coll c, void *sb, void *rb, size_t cnt, MPI_Datatype dt, MPI_Comm comm) {
    switch (c) {
    case C_ALLREDUCE: MPI_Allreduce(sb, rb, (int)cnt, dt, MPI_SUM, comm); break;
    case C_REDUCE_SCATTER: MPI_Reduce_scatter_block(sb, rb, (int)cnt, dt, MPI_SUM, comm); break;
    case C_ALLGATHER: MPI_Allgather(sb, (int)cnt, dt, rb, (int)cnt, dt, comm); break;
    case C_BCAST: MPI_Bcast(rb, (int)cnt, dt, 0, comm); break;
    }
}

static void usage(void) {
    fprintf(stderr, "usage: mpi_coll_perf [-b min] [-e max] [-f factor] [-n iters] [-w warmup]"
                    " [-d float|double] [-C allreduce|reduce_scatter|allgather|bcast]"
                    " [-T target_secs] [-J out.json]\n");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, nr;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nr);

    size_t minb = 32 << 20, maxb = 32 << 20;
    double factor = 2, target = 0;
    int iters_max = 20, warm = 5, isdbl = 0;
    enum coll coll = C_ALLREDUCE;
    const char *json = NULL;
    int opt;
    while ((opt = getopt(argc, argv, "b:e:f:n:w:d:C:T:J:h")) != -1) {
        switch (opt) {
        case 'b': minb = parse_size(optarg); break;
        case 'e': maxb = parse_size(optarg); break;
        case 'f': factor = atof(optarg); break;
        case 'n': iters_max = atoi(optarg); break;
        case 'w': warm = atoi(optarg); break;
        case 'T': target = atof(optarg); break;
        case 'J': json = optarg; break;
        case 'd':
            if (!strcasecmp(optarg, "float")) isdbl = 0;
            else if (!strcasecmp(optarg, "double")) isdbl = 1;
            else { if (!rank) fprintf(stderr, "type %s unsupported\n", optarg); MPI_Abort(MPI_COMM_WORLD, 2); }
            break;
        case 'C': {
            int k, found = 0;
            for (k = 0; k < 4; k++) if (!strcasecmp(optarg, coll_names[k])) { coll = k; found = 1; }
            if (!found) { if (!rank) fprintf(stderr, "collective %s unsupported\n", optarg); MPI_Abort(MPI_COMM_WORLD, 2); }
            break;
        }
        default: if (!rank) usage(); MPI_Finalize(); return opt == 'h' ? 0 : 2;
        }
    }
    if (factor <= 1) factor = 2;
    if (iters_max < 1) iters_max = 1;
    if (warm < 1) warm = 1;

    size_t es = isdbl ? sizeof(double) : sizeof(float);
    MPI_Datatype dt = isdbl ? MPI_DOUBLE : MPI_FLOAT;
    double busf = coll == C_ALLREDUCE ? 2.0 * (nr - 1) / nr : coll == C_BCAST ? 1.0 : (double)(nr - 1) / nr;
    /* buffers for the largest size: send = max (allreduce, reduce_scatter) or max/nr (allgather) */
    size_t maxelems = maxb / es + nr;
    void *sb = malloc(maxelems * es), *rb = malloc(maxelems * es);
    if (!sb || !rb) { fprintf(stderr, "rank %d: out of memory\n", rank); MPI_Abort(MPI_COMM_WORLD, 1); }
    memset(rb, 0, maxelems * es);

    FILE *jf = NULL;
    if (rank == 0) {
        char host[256] = "";
        gethostname(host, sizeof host - 1);
        int vlen; char ver[MPI_MAX_LIBRARY_VERSION_STRING];
        MPI_Get_library_version(ver, &vlen);
        char *nl = strchr(ver, '\n'); if (nl) *nl = 0;
        char *cm = strchr(ver, ','); if (cm) *cm = 0;
        printf("# mpi_coll_perf: %s, nranks %d, host %s, coll %s, type %s\n", ver, nr, host,
               coll_names[coll], isdbl ? "double" : "float");
        printf("# minBytes %zu maxBytes %zu step: %g(factor) iters: %d warmup: %d target: %gs\n",
               minb, maxb, factor, iters_max, warm, target);
        printf("#\n#%11s  %12s  %8s  %6s  %10s  %7s  %7s  %6s  %6s\n", "size", "count", "type", "redop",
               "time", "algbw", "busbw", "#wrong", "iters");
        printf("#%11s  %12s  %8s  %6s  %10s  %7s  %7s  %6s  %6s\n", "(B)", "(elements)", "", "", "(us)",
               "(GB/s)", "(GB/s)", "", "");
        fflush(stdout);
        if (json) {
            jf = fopen(json, "w");
            if (!jf) { perror(json); MPI_Abort(MPI_COMM_WORLD, 1); }
            fprintf(jf, "[");
        }
    }

    double bw_sum = 0;
    int nsizes = 0;
    long wrong_total = 0;
    for (size_t size = minb; size <= maxb; size = (size_t)((double)size * factor)) {
        /* elements per call argument, and total bytes (nccl-tests semantics) */
        size_t cnt, total_elems;
        if (coll == C_ALLREDUCE || coll == C_BCAST) { cnt = size / es; total_elems = cnt; }
        else { cnt = size / es / nr; total_elems = cnt * nr; }
        if (cnt == 0) { if (size * factor <= size) break; continue; }
        size_t bytes = total_elems * es;
        size_t sendn = coll == C_ALLGATHER ? cnt : total_elems;
        fill(sb, sendn, isdbl, rank, 0);
        if (coll == C_BCAST) fill(rb, cnt, isdbl, rank, 0);

        /* warmup; in -T mode it doubles batches until it has a stable estimate */
        run_coll(coll, sb, rb, cnt, dt, MPI_COMM_WORLD);
        double est = 0, warm_time = 0;
        int done = 1, k = 1;
        if (warm - done > 0 && target <= 0) k = warm - done;
        for (;;) {
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            for (int i = 0; i < k; i++) run_coll(coll, sb, rb, cnt, dt, MPI_COMM_WORLD);
            double d = MPI_Wtime() - t0, dmax;
            MPI_Allreduce(&d, &dmax, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            warm_time += dmax; done += k; est = dmax / k;
            if (target <= 0) { if (done >= warm) break; k = warm - done; continue; }
            if ((done >= warm && dmax >= 0.01) || warm_time >= target / 2 || done >= iters_max) break;
            k *= 2;
        }
        int iters = iters_max;
        if (target > 0) {
            double want = target / (est > 0 ? est : 1e-9);
            iters = want > iters_max ? iters_max : (int)want;
            if (iters < 3) iters = iters_max < 3 ? iters_max : 3;
        }

        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();
        for (int i = 0; i < iters; i++) run_coll(coll, sb, rb, cnt, dt, MPI_COMM_WORLD);
        double el = (MPI_Wtime() - t0) / iters, elsum;
        MPI_Allreduce(&el, &elsum, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
        double t = elsum / nr;

        /* check a sample of the result */
        long wrong = 0, wsum;
        size_t outn = coll == C_REDUCE_SCATTER ? cnt : coll == C_ALLGATHER ? total_elems : cnt;
        size_t stride = outn / 4096 + 1;
        for (size_t j = 0; j <= outn; j += stride) {
            size_t i = j < outn ? j : outn - 1; /* the last pass checks the last element */
            double expect = 0;
            if (coll == C_ALLREDUCE) for (int r = 0; r < nr; r++) expect += val(r, i);
            else if (coll == C_REDUCE_SCATTER) for (int r = 0; r < nr; r++) expect += val(r, rank * cnt + i);
            else if (coll == C_ALLGATHER) expect = val((int)(i / cnt), i % cnt);
            else expect = val(0, i);
            if (get(rb, i, isdbl) != expect) wrong++;
            if (j < outn && j + stride > outn) j = outn - stride; /* next pass: j == outn */
        }
        MPI_Allreduce(&wrong, &wsum, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
        wrong_total += wsum;

        double algbw = (double)bytes / t / 1e9, busbw = algbw * busf;
        bw_sum += busbw;
        nsizes++;
        if (rank == 0) {
            printf("%12zu  %12zu  %8s  %6s  %10.2f  %7.2f  %7.2f  %6ld  %6d\n", bytes, cnt,
                   isdbl ? "double" : "float", coll == C_ALLGATHER || coll == C_BCAST ? "none" : "sum",
                   t * 1e6, algbw, busbw, wsum, iters);
            fflush(stdout);
            if (jf)
                fprintf(jf, "%s\n {\"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": \"%s\", "
                            "\"coll\": \"%s\", \"nranks\": %d, \"iters\": %d, \"time_us\": %.3f, "
                            "\"algbw\": %.6f, \"busbw\": %.6f, \"wrong\": %ld}",
                        nsizes > 1 ? "," : "", bytes, cnt, isdbl ? "double" : "float",
                        coll == C_ALLGATHER || coll == C_BCAST ? "none" : "sum", coll_names[coll], nr,
                        iters, t * 1e6, algbw, busbw, wsum);
            /* each size reaches the file as soon as it is measured: a run stopped by a timeout
             * (perf-tests/compare) leaves the sizes it finished, "[" + objects, no closing "]" */
            if (jf) fflush(jf);
        }
        if ((double)size * factor > (double)maxb) break;
    }
    if (rank == 0) {
        printf("# Out of bounds values : %ld %s\n", wrong_total, wrong_total ? "FAILED" : "OK");
        printf("# Avg bus bandwidth    : %g\n#\n", nsizes ? bw_sum / nsizes : 0.0);
        if (jf) { fprintf(jf, "\n]\n"); fclose(jf); }
    }
    free(sb);
    free(rb);
    MPI_Finalize();
    return wrong_total ? 1 : 0;
}
