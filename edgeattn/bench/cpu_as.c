/* An x86-64 CPU that reports fewer instruction sets than it has: loaded with LD_PRELOAD, it turns on
 * Linux's CPUID faulting (arch_prctl ARCH_SET_CPUID 0) for the process, so that every CPUID instruction
 * raises SIGSEGV; the handler runs the real CPUID (faulting off for that one instruction) and clears the
 * bits of AVX-512, VNNI, AMX and their kin before handing the registers back. ONNX Runtime's MLAS,
 * llama.cpp's ggml, torch and numpy choose their kernels from CPUID, so they run their AVX2 kernels at
 * full speed on this CPU (an emulator would run them 10-100x slower). Used through edgeattn.bench.cpu_as.
 *
 * The mask is EDGEATTN_CPU_AS: "avx2" (AVX2 and FMA, no AVX-512, no VNNI of either width, no AMX: an
 * AMD EPYC of Zen 2/3's kind) or "avx-vnni" (the same with AVX-VNNI kept). On success it sets
 * EDGEATTN_CPU_AS_ACTIVE to the mask for the process and its children (each exec loads it again);
 * where the kernel or the CPU has no CPUID faulting it leaves the CPU as it is, unsets that variable and
 * says so on stderr once. EDGEATTN_CPU_AS_COUNT=1: the number of CPUID instructions answered, on stderr at
 * exit (a hot loop of CPUIDs would cost a signal each and skew a timing).
 */
#define _GNU_SOURCE
#include <asm/prctl.h>
#include <cpuid.h>
#include <dlfcn.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

static int keep_avx_vnni, active;
static atomic_long answered;
static struct sigaction previous; /* the SIGSEGV handler the process believes it has */

typedef int (*sigaction_fn)(int, const struct sigaction *, struct sigaction *);
static sigaction_fn real_sigaction_fn;

static int real_sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (!real_sigaction_fn) real_sigaction_fn = (sigaction_fn)dlsym(RTLD_NEXT, "sigaction");
    return real_sigaction_fn(sig, act, old);
}

/* Handlers installed later (Python's faulthandler, which pytest turns on) would otherwise take CPUID's
 * faults: while the mask is active, a SIGSEGV handler set through sigaction or signal becomes the one
 * chained to for faults that are not CPUID's, and ours stays first. */
int sigaction(int sig, const struct sigaction *act, struct sigaction *old) {
    if (sig != SIGSEGV || !active) return real_sigaction(sig, act, old);
    struct sigaction was = previous;
    if (act) previous = *act;
    if (old) *old = was;
    return 0;
}

sighandler_t signal(int sig, sighandler_t handler) {
    struct sigaction act, old;
    memset(&act, 0, sizeof act);
    act.sa_handler = handler;
    act.sa_flags = SA_RESTART;
    sigemptyset(&act.sa_mask);
    if (sigaction(sig, &act, &old) != 0) return SIG_ERR;
    return old.sa_handler;
}

static int set_faulting(int on) { return (int)syscall(SYS_arch_prctl, ARCH_SET_CPUID, on ? 0 : 1); }

static void mask(unsigned leaf, unsigned sub, unsigned *a, unsigned *b, unsigned *c, unsigned *d) {
    if (leaf == 7 && sub == 0) {
        /* EBX: AVX512F 16, DQ 17, IFMA 21, PF 26, ER 27, CD 28, BW 30, VL 31 */
        *b &= ~((1u << 16) | (1u << 17) | (1u << 21) | (1u << 26) | (1u << 27) | (1u << 28) | (1u << 30) |
                (1u << 31));
        /* ECX: VBMI 1, VBMI2 6, VNNI 11, BITALG 12, VPOPCNTDQ 14 */
        *c &= ~((1u << 1) | (1u << 6) | (1u << 11) | (1u << 12) | (1u << 14));
        /* EDX: 4VNNIW 2, 4FMAPS 3, VP2INTERSECT 8, AMX-BF16 22, FP16 23, AMX-TILE 24, AMX-INT8 25 */
        *d &= ~((1u << 2) | (1u << 3) | (1u << 8) | (1u << 22) | (1u << 23) | (1u << 24) | (1u << 25));
    } else if (leaf == 7 && sub == 1) {
        /* EAX: AVX-VNNI 4, AVX512_BF16 5, AMX-FP16 21, AVX-IFMA 23 */
        *a &= ~((keep_avx_vnni ? 0u : (1u << 4)) | (1u << 5) | (1u << 21) | (1u << 23));
        /* EDX: AVX-VNNI-INT8 4, AVX-NE-CONVERT 5, AMX-COMPLEX 8, AVX-VNNI-INT16 10, AVX10 19 */
        *d &= ~((1u << 4) | (1u << 5) | (1u << 8) | (1u << 10) | (1u << 19));
    } else if (leaf == 0xD && sub == 0) {
        /* XSAVE components: opmask 5, ZMM_Hi256 6, Hi16_ZMM 7, XTILECFG 17, XTILEDATA 18 */
        *a &= ~((1u << 5) | (1u << 6) | (1u << 7) | (1u << 17) | (1u << 18));
    } else if (leaf == 0x1D || leaf == 0x1E || leaf == 0x24) {
        *a = *b = *c = *d = 0; /* AMX tile and AVX10 leaves */
    }
}

static void on_segv(int sig, siginfo_t *info, void *raw) {
    ucontext_t *uc = (ucontext_t *)raw;
    greg_t *r = uc->uc_mcontext.gregs;
    const unsigned char *ip = (const unsigned char *)r[REG_RIP];
    if (info->si_code == SI_KERNEL && ip[0] == 0x0F && ip[1] == 0xA2) {
        unsigned leaf = (unsigned)r[REG_RAX], sub = (unsigned)r[REG_RCX], a, b, c, d;
        set_faulting(0);
        __cpuid_count(leaf, sub, a, b, c, d);
        set_faulting(1);
        mask(leaf, sub, &a, &b, &c, &d);
        r[REG_RAX] = a;
        r[REG_RBX] = b;
        r[REG_RCX] = c;
        r[REG_RDX] = d;
        r[REG_RIP] += 2;
        atomic_fetch_add(&answered, 1);
        return;
    }
    /* not ours: the previous handler, or the default action */
    if (previous.sa_flags & SA_SIGINFO) {
        previous.sa_sigaction(sig, info, raw);
    } else if (previous.sa_handler != SIG_IGN && previous.sa_handler != SIG_DFL) {
        previous.sa_handler(sig);
    } else {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        real_sigaction(sig, &dfl, NULL);
        if (info->si_code <= 0) raise(sig); /* sent, not a fault: a fault repeats on return */
    }
}

static void report(void) { fprintf(stderr, "cpu_as: %ld CPUID instructions answered\n", (long)answered); }

__attribute__((constructor)) static void cpu_as_init(void) {
    const char *as = getenv("EDGEATTN_CPU_AS");
    unsetenv("EDGEATTN_CPU_AS_ACTIVE");
    if (!as || !*as) return;
    if (strcmp(as, "avx2") && strcmp(as, "avx-vnni")) {
        fprintf(stderr, "cpu_as: EDGEATTN_CPU_AS must be avx2 or avx-vnni, got %s; the CPU left as it is\n", as);
        return;
    }
    keep_avx_vnni = !strcmp(as, "avx-vnni");
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    if (real_sigaction(SIGSEGV, &sa, &previous) != 0) return;
    if (set_faulting(1) != 0) {
        real_sigaction(SIGSEGV, &previous, NULL);
        fprintf(stderr, "cpu_as: this CPU or kernel has no CPUID faulting; the CPU left as it is\n");
        return;
    }
    active = 1;
    setenv("EDGEATTN_CPU_AS_ACTIVE", as, 1);
    const char *count = getenv("EDGEATTN_CPU_AS_COUNT");
    if (count && !strcmp(count, "1")) atexit(report);
}
