/*
 * gpu_serde stand-in CUDA driver: contexts, streams and events.
 *
 * Every device has one primary context; each thread has a context stack (cuCtxSetCurrent replaces
 * its top). Work is done when it is issued (a copy or a memset runs inside the call). By default streams
 * and events only keep their flags: synchronising returns at once and every event is complete when
 * recorded. With GPU_SERDE_SIM_WORK_MS=t, each copy or memset queued on a stream counts as t ms of
 * work behind the stream's earlier work: until then the stream and the events recorded behind it
 * report CUDA_ERROR_NOT_READY, and synchronising waits (the bytes have already moved). Event times
 * are host clock readings, meaningless as GPU timings. An IPC event handle names the exporting
 * process, the event and a memory file of the event's own where its recordings' done time is kept
 * (a CLOCK_MONOTONIC reading: one clock for the host's processes); opening it in another process
 * of the same user maps that file read-only, so the opened event is busy while the exporter's is.
 * Where the file cannot be opened (another PID namespace), the opened event is always complete.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "simdriver.h"

pthread_mutex_t sim_lock = PTHREAD_MUTEX_INITIALIZER;

/* legacy, blocking, last: when work queued there is done (see "work in flight" below) */
struct sim_ctx {
    uint32_t magic; int device; int retained; unsigned flags; unsigned long long id;
    double legacy, blocking, last;
};
#define CTX_MAGIC 0x43545853u
static void sim_sleep_until(double when);
static struct sim_ctx primary[MAX_GPUS];
static __thread CUcontext ctx_stack[32];
static __thread int ctx_depth = 0;
static unsigned long long next_id = 1;

CUcontext sim_current_ctx(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : NULL; }

int sim_ctx_device(CUcontext ctx) {
    return (ctx && ctx->magic == CTX_MAGIC) ? ctx->device : -1;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *out, CUdevice dev) {
    CUresult r = sim_check_device(dev);
    if (r) return sim_fail(r, __func__);
    if (!out) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_ctx *c = &primary[dev];
    if (c->magic != CTX_MAGIC) { c->magic = CTX_MAGIC; c->device = dev; c->id = next_id++; }
    c->retained++;
    pthread_mutex_unlock(&sim_lock);
    *out = c;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CUresult r = sim_check_device(dev);
    if (r) return sim_fail(r, __func__);
    pthread_mutex_lock(&sim_lock);
    if (primary[dev].retained > 0) primary[dev].retained--;
    pthread_mutex_unlock(&sim_lock);
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxGetState(CUdevice dev, unsigned *flags, int *active) {
    CUresult r = sim_check_device(dev);
    if (r) return sim_fail(r, __func__);
    if (!flags || !active) return sim_fail(INVALID_VALUE, __func__);
    *flags = primary[dev].flags;
    *active = primary[dev].retained > 0;
    return SUCCESS;
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice dev, unsigned flags) {
    CUresult r = sim_check_device(dev);
    if (r) return sim_fail(r, __func__);
    primary[dev].flags = flags;
    return SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (ctx && sim_ctx_device(ctx) < 0) return sim_fail(INVALID_CONTEXT, __func__);
    if (ctx_depth == 0) {
        if (ctx) ctx_stack[ctx_depth++] = ctx;
    } else if (ctx) {
        ctx_stack[ctx_depth - 1] = ctx;
    } else {
        ctx_depth--;
    }
    return SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext *ctx) {
    if (!ctx) return sim_fail(INVALID_VALUE, __func__);
    *ctx = sim_current_ctx();
    return SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    if (sim_ctx_device(ctx) < 0) return sim_fail(INVALID_CONTEXT, __func__);
    if (ctx_depth >= 32) return sim_fail(OUT_OF_MEMORY, __func__);
    ctx_stack[ctx_depth++] = ctx;
    return SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext *ctx) {
    if (ctx_depth == 0) return sim_fail(INVALID_CONTEXT, __func__);
    CUcontext top = ctx_stack[--ctx_depth];
    if (ctx) *ctx = top;
    return SUCCESS;
}

/* No current context: INVALID_CONTEXT (cuda.core then takes device 0, as before contexts existed). */
CUresult cuCtxGetDevice(CUdevice *dev) {
    CUcontext c = sim_current_ctx();
    if (!c) return INVALID_CONTEXT;
    if (!dev) return sim_fail(INVALID_VALUE, __func__);
    *dev = c->device;
    return SUCCESS;
}

CUresult cuCtxGetDevice_v2(CUdevice *dev, CUcontext ctx) {
    if (!ctx) return cuCtxGetDevice(dev);
    if (sim_ctx_device(ctx) < 0) return sim_fail(INVALID_CONTEXT, __func__);
    if (!dev) return sim_fail(INVALID_VALUE, __func__);
    *dev = ctx->device;
    return SUCCESS;
}

CUresult cuCtxGetId(CUcontext ctx, unsigned long long *id) {
    if (!ctx) ctx = sim_current_ctx();
    if (sim_ctx_device(ctx) < 0) return sim_fail(INVALID_CONTEXT, __func__);
    if (!id) return sim_fail(INVALID_VALUE, __func__);
    *id = ctx->id;
    return SUCCESS;
}

CUresult cuCtxGetApiVersion(CUcontext ctx, unsigned *version) {
    if (!ctx) ctx = sim_current_ctx();
    if (sim_ctx_device(ctx) < 0) return sim_fail(INVALID_CONTEXT, __func__);
    if (!version) return sim_fail(INVALID_VALUE, __func__);
    *version = 13000;
    return SUCCESS;
}

CUresult cuCtxGetFlags(unsigned *flags) {
    CUcontext c = sim_current_ctx();
    if (!c) return sim_fail(INVALID_CONTEXT, __func__);
    if (!flags) return sim_fail(INVALID_VALUE, __func__);
    *flags = c->flags;
    return SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    CUcontext c = sim_current_ctx();
    if (!c) return sim_fail(INVALID_CONTEXT, __func__);
    pthread_mutex_lock(&sim_lock);
    double when = c->last;
    pthread_mutex_unlock(&sim_lock);
    sim_sleep_until(when);
    return SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int *least, int *greatest) {
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return SUCCESS;
}

/* ---- work in flight (GPU_SERDE_SIM_WORK_MS) ----
 * Each async copy or memset is `work` seconds of work on its stream, done after the work queued
 * there before it. Done times are CLOCK_MONOTONIC seconds, read and written under sim_lock: a
 * created stream keeps its own; per context, `legacy` is the legacy default stream's, `blocking`
 * the latest of its blocking streams' (made without CU_STREAM_NON_BLOCKING, and each thread's
 * per-thread default stream), which the legacy stream waits for and which wait for it, and `last`
 * the latest of all. */
static double work = 0; /* seconds per async copy or memset: 0 without GPU_SERDE_SIM_WORK_MS */
static __thread double per_thread[MAX_GPUS]; /* this thread's per-thread default streams */
#define NON_BLOCKING 1u

/* Read once, when the driver is loaded (a process that sets it later changes nothing half-way);
 * a bad value is said on stderr and ignored. */
__attribute__((constructor)) static void read_work(void) {
    const char *t = getenv("GPU_SERDE_SIM_WORK_MS");
    if (!t || !*t) return;
    char *end;
    double v = strtod(t, &end);
    if (end != t && *end == '\0' && isfinite(v) && v >= 0 && v <= 3.6e6) {
        work = v / 1e3;
        return;
    }
    char shown[41];
    size_t n = 0;
    for (; t[n] && n < sizeof shown - 1; n++) shown[n] = (t[n] >= 0x20 && t[n] < 0x7f) ? t[n] : '?';
    shown[n] = '\0';
    fprintf(stderr, "gpu_serde simulated driver: GPU_SERDE_SIM_WORK_MS=%s%s is not a number of "
            "milliseconds from 0 to 3600000: ignored, no work is in flight\n", shown, t[n] ? "..." : "");
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void sim_sleep_until(double when) {
    double left = when - now_s();
    if (left <= 0) return;
    struct timespec t = {(time_t)left, (long)((left - (double)(time_t)left) * 1e9)};
    while (nanosleep(&t, &t) != 0) {}
}

static double later(double a, double b) { return a > b ? a : b; }

/* ---- streams ---- */
struct sim_stream {
    uint32_t magic; int device; CUcontext ctx; unsigned flags; int priority; unsigned long long id;
    double busy; /* when the work queued on it is done */
};
#define STREAM_MAGIC 0x4d525453u
#define LEGACY_STREAM ((CUstream)0x1)
#define PER_THREAD_STREAM ((CUstream)0x2)

/* The device a stream belongs to; the default streams belong to the current context's. */
CUresult sim_stream_check(CUstream s, int *device) {
    if (s == NULL || s == LEGACY_STREAM || s == PER_THREAD_STREAM) {
        CUcontext c = sim_current_ctx();
        if (!c) return INVALID_CONTEXT;
        if (device) *device = c->device;
        return SUCCESS;
    }
    if (s->magic != STREAM_MAGIC) return INVALID_HANDLE;
    if (device) *device = s->device;
    return SUCCESS;
}

#define IS_DEFAULT(s) ((s) == NULL || (s) == LEGACY_STREAM || (s) == PER_THREAD_STREAM)

/* Stream s's own done time (NULL: none), its context, and how it waits for others: 1 for the
 * legacy stream, 2 for a blocking stream, 0 for a non-blocking one. Under sim_lock. */
static double *own_busy(CUstream s, CUcontext *ctx, int *kind) {
    if (IS_DEFAULT(s)) {
        CUcontext c = sim_current_ctx();
        *ctx = c;
        if (!c) return NULL;
        *kind = s == PER_THREAD_STREAM ? 2 : 1;
        return s == PER_THREAD_STREAM ? &per_thread[c->device] : &c->legacy;
    }
    *ctx = s->ctx;
    *kind = (s->flags & NON_BLOCKING) ? 0 : 2;
    return s->magic == STREAM_MAGIC ? &s->busy : NULL;
}

/* When the work queued on s so far is done: its own, and the legacy stream's or the blocking
 * streams' it waits for. Under sim_lock. */
static double ready_locked(CUstream s) {
    CUcontext c;
    int kind = 0;
    double *own = own_busy(s, &c, &kind);
    if (!own) return 0;
    return later(*own, kind == 1 ? c->blocking : kind == 2 ? c->legacy : 0);
}

/* s also waits for work done at `when`. Under sim_lock. */
static void after_locked(CUstream s, double when) {
    CUcontext c;
    int kind = 0;
    double *own = own_busy(s, &c, &kind);
    if (!own) return;
    *own = later(*own, when);
    if (kind == 2) c->blocking = later(c->blocking, *own);
    c->last = later(c->last, *own);
}

/* When the work queued on stream s (already checked) is done (0 without work in flight: no lock). */
static double stream_ready(CUstream s) {
    if (work <= 0) return 0;
    pthread_mutex_lock(&sim_lock);
    double when = ready_locked(s);
    pthread_mutex_unlock(&sim_lock);
    return when;
}

void sim_stream_queue(CUstream s) {
    if (work <= 0) return;
    double now = now_s();
    pthread_mutex_lock(&sim_lock);
    after_locked(s, later(ready_locked(s), now) + work);
    pthread_mutex_unlock(&sim_lock);
}

void sim_wait_legacy(void) {
    if (work > 0) sim_sleep_until(stream_ready(LEGACY_STREAM));
}

CUresult cuStreamCreateWithPriority(CUstream *out, unsigned flags, int priority) {
    CUcontext c = sim_current_ctx();
    if (!c) return sim_fail(INVALID_CONTEXT, __func__);
    if (!out) return sim_fail(INVALID_VALUE, __func__);
    struct sim_stream *s = calloc(1, sizeof *s);
    if (!s) return sim_fail(OUT_OF_MEMORY, __func__);
    pthread_mutex_lock(&sim_lock);
    *s = (struct sim_stream){STREAM_MAGIC, c->device, c, flags, priority, next_id++, 0};
    pthread_mutex_unlock(&sim_lock);
    *out = s;
    return SUCCESS;
}

CUresult cuStreamCreate(CUstream *out, unsigned flags) { return cuStreamCreateWithPriority(out, flags, 0); }

CUresult cuStreamDestroy_v2(CUstream s) {
    if (!s || s == LEGACY_STREAM || s == PER_THREAD_STREAM || s->magic != STREAM_MAGIC)
        return sim_fail(INVALID_HANDLE, __func__);
    s->magic = 0;
    free(s);
    return SUCCESS;
}

#define STREAM_OP(name)                                         \
    CUresult r = sim_stream_check(s, NULL);                     \
    if (r) return sim_fail(r, name);
CUresult cuStreamSynchronize(CUstream s) { STREAM_OP(__func__) sim_sleep_until(stream_ready(s)); return SUCCESS; }
/* Not an error: no trace for a stream still at work. */
CUresult cuStreamQuery(CUstream s) { STREAM_OP(__func__) return now_s() < stream_ready(s) ? NOT_READY : SUCCESS; }
static double event_busy_locked(CUevent e);
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned flags) {
    (void)flags; STREAM_OP(__func__)
    if (work <= 0) return SUCCESS; /* nothing is ever in flight */
    pthread_mutex_lock(&sim_lock);
    after_locked(s, event_busy_locked(e));
    pthread_mutex_unlock(&sim_lock);
    return SUCCESS;
}
CUresult cuStreamGetPriority(CUstream s, int *p) {
    STREAM_OP(__func__)
    if (!p) return sim_fail(INVALID_VALUE, __func__);
    *p = (s == NULL || s == LEGACY_STREAM || s == PER_THREAD_STREAM) ? 0 : s->priority;
    return SUCCESS;
}
CUresult cuStreamGetFlags(CUstream s, unsigned *f) {
    STREAM_OP(__func__)
    if (!f) return sim_fail(INVALID_VALUE, __func__);
    *f = (s == NULL || s == LEGACY_STREAM || s == PER_THREAD_STREAM) ? 0 : s->flags;
    return SUCCESS;
}
CUresult cuStreamGetId(CUstream s, unsigned long long *id) {
    STREAM_OP(__func__)
    if (!id) return sim_fail(INVALID_VALUE, __func__);
    *id = (s == NULL || s == LEGACY_STREAM || s == PER_THREAD_STREAM) ? (uintptr_t)s : s->id;
    return SUCCESS;
}
CUresult cuStreamGetDevice(CUstream s, CUdevice *dev) {
    int d;
    CUresult r = sim_stream_check(s, &d);
    if (r) return sim_fail(r, __func__);
    if (!dev) return sim_fail(INVALID_VALUE, __func__);
    *dev = d;
    return SUCCESS;
}
CUresult cuStreamGetCtx(CUstream s, CUcontext *ctx) {
    STREAM_OP(__func__)
    if (!ctx) return sim_fail(INVALID_VALUE, __func__);
    *ctx = (s == NULL || s == LEGACY_STREAM || s == PER_THREAD_STREAM) ? sim_current_ctx() : s->ctx;
    return SUCCESS;
}

/* ---- events ---- */
struct sim_event {
    uint32_t magic; unsigned flags; int recorded; struct timespec t;
    CUcontext ctx; /* where it was made (or opened) */
    double busy;   /* when the work it was recorded behind is done (under sim_lock) */
    /* an interprocess event's shared page: [0] the done time (its bits), [1] the exporting
     * event's address (what an opener checks); NULL without one. fd: the exporter's file. */
    uint64_t *shared; int fd;
};
#define EVENT_MAGIC 0x544e5645u
#define EV_DISABLE_TIMING 2u
#define EV_INTERPROCESS 4u
#define SHARED_BYTES 4096
#define SHARED_NAME "gpu_serde-sim-event"
static const char ipc_event_tag[8] = "GSSIMEVT";

static int event_ok(CUevent e) { return e && e->magic == EVENT_MAGIC; }

static double shared_busy(const uint64_t *page) {
    uint64_t bits = __atomic_load_n(page, __ATOMIC_ACQUIRE);
    double when;
    memcpy(&when, &bits, sizeof when);
    return isfinite(when) ? when : 0; /* a page that says nonsense is no wait */
}

/* When the work an event was recorded behind is done (0: never recorded; an event opened from
 * another process: when the exporter's is). Under sim_lock. */
static double event_busy_locked(CUevent e) {
    if (!event_ok(e)) return 0;
    return e->shared ? shared_busy(e->shared) : e->busy;
}

static double event_busy(CUevent e) {
    if (event_ok(e) && e->shared) return shared_busy(e->shared); /* the exporter's work setting */
    if (work <= 0) return 0;
    pthread_mutex_lock(&sim_lock);
    double when = event_busy_locked(e);
    pthread_mutex_unlock(&sim_lock);
    return when;
}

/* An interprocess event's page, in a memory file of its own that openers map (-1: none to be
 * had, and openers see the event complete). */
static void share_event(struct sim_event *e) {
    e->fd = -1;
    int fd = memfd_create(SHARED_NAME, MFD_CLOEXEC);
    if (fd < 0) return;
    void *page = MAP_FAILED;
    if (ftruncate(fd, SHARED_BYTES) == 0)
        page = mmap(NULL, SHARED_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (page == MAP_FAILED) { close(fd); return; }
    e->shared = page;
    e->shared[1] = (uintptr_t)e;
    e->fd = fd;
}

/* The exporter's page of an event it named in a handle, mapped read-only; NULL when it cannot be
 * (gone, another PID namespace, or not that event's page any more). */
static uint64_t *open_shared(int32_t pid, int32_t fd, uint64_t addr) {
    if (fd < 0) return NULL;
    char path[64], target[128];
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)pid, (int)fd);
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0) return NULL;
    target[n] = 0;
    if (strncmp(target, "/memfd:" SHARED_NAME, strlen("/memfd:" SHARED_NAME)) != 0) return NULL;
    int own = open(path, O_RDONLY | O_CLOEXEC);
    if (own < 0) return NULL;
    struct stat st;
    void *page = MAP_FAILED;
    if (fstat(own, &st) == 0 && st.st_size == SHARED_BYTES)
        page = mmap(NULL, SHARED_BYTES, PROT_READ, MAP_SHARED, own, 0);
    close(own);
    if (page == MAP_FAILED) return NULL;
    uint64_t *shared = page;
    if (shared[1] != addr) { munmap(page, SHARED_BYTES); return NULL; } /* another event's */
    return shared;
}

CUresult cuEventCreate(CUevent *out, unsigned flags) {
    if (!sim_current_ctx()) return sim_fail(INVALID_CONTEXT, __func__);
    if (!out || flags & ~7u) return sim_fail(INVALID_VALUE, __func__);
    if ((flags & EV_INTERPROCESS) && !(flags & EV_DISABLE_TIMING)) return sim_fail(INVALID_VALUE, __func__);
    struct sim_event *e = calloc(1, sizeof *e);
    if (!e) return sim_fail(OUT_OF_MEMORY, __func__);
    e->magic = EVENT_MAGIC;
    e->flags = flags;
    e->ctx = sim_current_ctx();
    e->fd = -1;
    if (flags & EV_INTERPROCESS) share_event(e);
    *out = e;
    return SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream s) {
    if (!event_ok(e)) return sim_fail(INVALID_HANDLE, __func__);
    CUresult r = sim_stream_check(s, NULL);
    if (r) return sim_fail(r, __func__);
    CUcontext sc = IS_DEFAULT(s) ? sim_current_ctx() : s->ctx;
    if (e->ctx && sc != e->ctx) return sim_fail(INVALID_HANDLE, __func__); /* another GPU's */
    clock_gettime(CLOCK_MONOTONIC, &e->t);
    e->recorded = 1;
    if (work > 0) {
        pthread_mutex_lock(&sim_lock);
        e->busy = ready_locked(s);
        if (e->shared && e->fd >= 0) { /* the exporter's own: its openers read it */
            uint64_t bits;
            memcpy(&bits, &e->busy, sizeof bits);
            __atomic_store_n(e->shared, bits, __ATOMIC_RELEASE);
        }
        pthread_mutex_unlock(&sim_lock);
    }
    return SUCCESS;
}

CUresult cuEventRecordWithFlags(CUevent e, CUstream s, unsigned flags) { (void)flags; return cuEventRecord(e, s); }
CUresult cuEventSynchronize(CUevent e) {
    if (!event_ok(e)) return sim_fail(INVALID_HANDLE, __func__);
    sim_sleep_until(event_busy(e));
    return SUCCESS;
}
CUresult cuEventQuery(CUevent e) {
    if (!event_ok(e)) return sim_fail(INVALID_HANDLE, __func__);
    return now_s() < event_busy(e) ? NOT_READY : SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent e) {
    if (!event_ok(e)) return sim_fail(INVALID_HANDLE, __func__);
    e->magic = 0;
    if (e->shared) munmap(e->shared, SHARED_BYTES);
    if (e->fd >= 0) close(e->fd);
    free(e);
    return SUCCESS;
}

CUresult cuEventElapsedTime_v2(float *ms, CUevent a, CUevent b) {
    if (!ms) return sim_fail(INVALID_VALUE, __func__);
    if (!event_ok(a) || !event_ok(b)) return sim_fail(INVALID_HANDLE, __func__);
    if ((a->flags | b->flags) & EV_DISABLE_TIMING) return sim_fail(INVALID_HANDLE, __func__);
    if (!a->recorded || !b->recorded) return sim_fail(INVALID_HANDLE, __func__);
    *ms = (float)((double)(b->t.tv_sec - a->t.tv_sec) * 1e3 + (double)(b->t.tv_nsec - a->t.tv_nsec) / 1e6);
    return SUCCESS;
}

CUresult cuIpcGetEventHandle(CUipcEventHandle *h, CUevent e) {
    if (!h) return sim_fail(INVALID_VALUE, __func__);
    if (!event_ok(e)) return sim_fail(INVALID_HANDLE, __func__);
    if (!(e->flags & EV_INTERPROCESS)) return sim_fail(INVALID_VALUE, __func__);
    memset(h, 0, sizeof *h);
    int32_t pid = getpid(), fd = e->fd;
    uint64_t addr = (uintptr_t)e;
    memcpy(h->reserved, ipc_event_tag, 8);
    memcpy(h->reserved + 8, &pid, 4);
    memcpy(h->reserved + 12, &fd, 4);
    memcpy(h->reserved + 16, &addr, 8);
    return SUCCESS;
}

/* The handle is passed by value, as in the real API. */
CUresult cuIpcOpenEventHandle(CUevent *out, CUipcEventHandle h) {
    if (!out) return sim_fail(INVALID_VALUE, __func__);
    if (!sim_current_ctx()) return sim_fail(INVALID_CONTEXT, __func__);
    int32_t pid, fd;
    uint64_t addr;
    memcpy(&pid, h.reserved + 8, 4);
    memcpy(&fd, h.reserved + 12, 4);
    memcpy(&addr, h.reserved + 16, 8);
    if (memcmp(h.reserved, ipc_event_tag, 8) != 0) return sim_fail(INVALID_VALUE, __func__);
    if (pid == getpid()) return sim_fail(INVALID_CONTEXT, __func__); /* no self-import */
    struct sim_event *e = calloc(1, sizeof *e);
    if (!e) return sim_fail(OUT_OF_MEMORY, __func__);
    e->magic = EVENT_MAGIC;
    e->flags = EV_INTERPROCESS | EV_DISABLE_TIMING;
    e->recorded = 1;
    e->ctx = sim_current_ctx();
    e->fd = -1; /* the page is the exporter's: mapped here, not written */
    e->shared = open_shared(pid, fd, addr);
    *out = e;
    return SUCCESS;
}

/* Nothing is ever captured into a graph here. */
CUresult cuStreamIsCapturing(CUstream s, int *status) {
    STREAM_OP(__func__)
    if (!status) return sim_fail(INVALID_VALUE, __func__);
    *status = 0;
    return SUCCESS;
}
