/* Copies between the daemon's pool and an engine file it has mapped, without dying when the
 * engine cuts that file short: a load or store past the end of a shared file mapping raises SIGBUS,
 * which would kill the daemon and every client's objects with it. tierd.transfer.mapcopy builds and
 * loads this file; see its docstring for why a copy is not a preadv/pwritev.
 *
 * A copy arms a guard for its own thread only (a thread-local jump buffer); the SIGBUS handler
 * jumps back to the copy when the faulting thread holds an armed guard, and otherwise hands the
 * signal to the disposition it replaced (or the default one, which ends the process as before).
 */
#define _GNU_SOURCE
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

/* initial-exec: reading it in the handler never allocates (a dlopen'd library's TLS otherwise may);
 * volatile: the compiler knows memcpy reads no global, and would otherwise drop the stores around it */
static __thread sigjmp_buf *volatile guard __attribute__((tls_model("initial-exec")));
static struct sigaction previous;
static int installed;

static void on_sigbus(int sig, siginfo_t *info, void *ctx) {
    sigjmp_buf *g = guard;
    if (g != NULL) {
        guard = NULL;
        siglongjmp(*g, 1);
    }
    if (previous.sa_flags & SA_SIGINFO) {
        if (previous.sa_sigaction != NULL) {
            previous.sa_sigaction(sig, info, ctx);
            return;
        }
    } else if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        previous.sa_handler(sig);
        return;
    }
    /* not a guarded copy's fault and nobody else's handler: returning repeats the access, which
     * the default disposition now ends as it would have without this handler */
    signal(SIGBUS, SIG_DFL);
}

/* Install the SIGBUS handler once per process; 0 on success, -1 (errno) otherwise. */
int tierd_mapcopy_install(void) {
    if (installed) return 0;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_sigbus;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (sigaction(SIGBUS, &sa, &previous) != 0) return -1;
    installed = 1;
    return 0;
}

/* 1 while this library's handler is the process's SIGBUS disposition. */
int tierd_mapcopy_armed(void) {
    struct sigaction now;
    if (sigaction(SIGBUS, NULL, &now) != 0) return 0;
    return (now.sa_flags & SA_SIGINFO) && now.sa_sigaction == on_sigbus;
}

/* A range at least this long is copied with non-temporal stores where the CPU has them. The C
 * library switches to them only for copies near the size of the last-level cache; below that its
 * stores first read every destination line into the cache, and a KV range (a layer of a chunk,
 * 128 KiB to a few MiB) copied that way moved well below a large memcpy's rate. Ranges are often
 * far shorter: vLLM's CPU layout keeps K and V apart, so a block is two ranges per layer (32 KiB
 * for 64 KiB blocks, 4 KiB for 8 KiB ones), and those gain from streaming too (tierd bench --runs 2
 * measures it against the same run's memcpy). */
#define STREAM_MIN (4u << 10)

static void copy_range(char *dst, const char *src, size_t n) {
#if defined(__x86_64__) && defined(__SSE2__)
    if (n >= STREAM_MIN) {
        size_t head = (size_t)(-(uintptr_t)dst & 15); /* to a 16-byte aligned destination */
        memcpy(dst, src, head);
        dst += head;
        src += head;
        n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        _mm_sfence(); /* the streamed lines are visible before the copy is reported done */
    }
#endif
    memcpy(dst, src, n);
}

/* Copy n ranges in order: len[i] bytes from src[i] to dst[i]. Returns n, or the index of the range
 * a SIGBUS stopped (its bytes and those after it not, or not all, copied). */
int64_t tierd_mapcopy(const uint64_t *dst, const uint64_t *src, const uint64_t *len, int64_t n) {
    sigjmp_buf jb;
    volatile int64_t i = 0;
    if (sigsetjmp(jb, 1) != 0) return i; /* the handler disarmed the guard before it jumped */
    guard = &jb;
    for (; i < n; i++) copy_range((char *)(uintptr_t)dst[i], (const char *)(uintptr_t)src[i], (size_t)len[i]);
    guard = NULL;
    return n;
}

/* A shared read-write mapping of the first size bytes of fd, or NULL (errno). */
void *tierd_mapcopy_map(int fd, uint64_t size) {
    void *p = mmap(NULL, (size_t)size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, (size_t)size, MADV_HUGEPAGE); /* huge pages where the memory's setting allows (advisory) */
#endif
    return p;
}

int tierd_mapcopy_unmap(void *p, uint64_t size) { return munmap(p, (size_t)size); }
