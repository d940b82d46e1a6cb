/*
 * gpu_serde stand-in CUDA driver: memory pools and plain allocations (pool IPC is in simipc.c).
 *
 * A "device pointer" is a host address. Each pool is one memfd: a 1 MiB header (shared state: the
 * pool's identity, its live allocations and who imported each) followed by the pool's bytes, mapped
 * shared and sparse, so an importer that maps the exported descriptor sees the same bytes and a pool
 * costs memory only where it is written. One memfd per pool (not per allocation) is what lets one
 * exported descriptor serve every later cuMemPoolImportPointer, as with the real driver. Freed
 * blocks are punched out of the memfd, so their memory goes back to the system at once.
 *
 * Rules kept: a pointer exported from a pool imports only into an import of that pool;
 * a destroyed pool lives on until its last allocation is freed, then its memory
 * is gone; an import of a freed allocation, or from a destroyed pool, fails with
 * CUDA_ERROR_INVALID_VALUE; an exporter that frees memory that a live importer still holds breaks the
 * CUDA rule (importers free first): the driver counts it, says so on stderr, and the importer's
 * bytes read as zeros (GPU_SERDE_SIM_STRICT=1 aborts instead).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simpool.h"

const char sim_pool_tag[8] = "GSSIMPOL";

/* ---- the ranges this process can address ---- */
static struct sim_range *ranges;
static size_t n_ranges, cap_ranges;
static long violations;
size_t sim_device_bytes;

struct sim_range *sim_range_find(uintptr_t p, size_t n) {
    for (size_t i = 0; i < n_ranges; i++)
        if (p >= ranges[i].base && p - ranges[i].base + n <= ranges[i].size) return &ranges[i];
    return NULL;
}

struct sim_range *sim_range_at(uintptr_t base) {
    for (size_t i = 0; i < n_ranges; i++) if (ranges[i].base == base) return &ranges[i];
    return NULL;
}

int sim_range_add(struct sim_range r) {
    if (n_ranges == cap_ranges) {
        size_t cap = cap_ranges ? 2 * cap_ranges : 64;
        struct sim_range *grown = realloc(ranges, cap * sizeof *grown);
        if (!grown) return -1;
        ranges = grown; cap_ranges = cap;
    }
    ranges[n_ranges++] = r;
    return 0;
}

void sim_range_remove(uintptr_t base) {
    for (size_t i = 0; i < n_ranges; i++)
        if (ranges[i].base == base) { ranges[i] = ranges[--n_ranges]; return; }
}

void sim_punch(int fd, size_t offset, size_t size) {
    if (fd >= 0 && size) fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)offset, (off_t)size);
}

int sim_memfd(const char *name, size_t size) {
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd < 0) return -1;
    if (ftruncate(fd, (off_t)size) != 0) { close(fd); return -1; }
    return fd;
}

/* Exporter freed memory that a live importer holds. */
static void violation(const char *what, uintptr_t p) {
    violations++;
    fprintf(stderr, "gpu_serde simulated driver: %s 0x%lx while another process still holds it "
            "(CUDA: importers free first; a pool's buffer closed while a receiver holds it: close it once "
            "they let go, or allocate it from a gpu_serde.ArenaMemoryResource)\n", what, (unsigned long)p);
    const char *strict = getenv("GPU_SERDE_SIM_STRICT");
    if (strict && strcmp(strict, "1") == 0) abort();
}

/* ---- pools ---- */
static struct sim_pool *default_pool[MAX_GPUS], *current_pool[MAX_GPUS];

int sim_live_importers(struct rec *r) {
    int n = 0;
    for (int i = 0; i < MAX_IMPORTERS; i++)
        if (r->count[i] > 0 && (kill(r->pid[i], 0) == 0 || errno == EPERM)) n++;
    return n;
}

static CUresult pool_make(struct sim_pool **out, int device, const CUmemPoolProps *props) {
    size_t max = props->maxSize ? props->maxSize : DEFAULT_POOL_SIZE;
    max = (max + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
    int fd = sim_memfd("gpu_serde-sim-pool", HDR_SIZE + max);
    if (fd < 0) return OUT_OF_MEMORY;
    char *map = mmap(NULL, HDR_SIZE + max, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (map == MAP_FAILED) { close(fd); return OUT_OF_MEMORY; }
    struct hdr *h = (struct hdr *)map;
    memcpy(h->tag, sim_pool_tag, 8);
    h->version = 1; h->exporter = getpid(); h->max_size = max;
    h->loc_type = props->location.type; h->loc_id = props->location.id;
    h->handle_types = props->handleTypes;
    int rnd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (rnd < 0 || read(rnd, h->id, 16) != 16) { uint64_t t = (uintptr_t)h ^ (uint64_t)getpid(); memcpy(h->id, &t, 8); }
    if (rnd >= 0) close(rnd);
    if (device >= 0) memcpy(h->device_uuid, sim_device_uuid(device), 16);
    pthread_mutexattr_t a;
    pthread_mutexattr_init(&a);
    pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
    pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
    pthread_mutex_init(&h->lock, &a);
    struct sim_pool *p = calloc(1, sizeof *p);
    if (!p) { munmap(map, HDR_SIZE + max); close(fd); return OUT_OF_MEMORY; }
    *p = (struct sim_pool){POOL_MAGIC, device, 0, fd, h, map + HDR_SIZE, max, 0, 0, 0, 0, {1, 1, 1}, 3, 0};
    *out = p;
    return SUCCESS;
}

static int pool_device(const CUmemPoolProps *props) {
    return props->location.type == LOC_DEVICE ? props->location.id : -1;
}

CUresult cuMemPoolCreate(CUmemoryPool *out, const CUmemPoolProps *props) {
    if (!out || !props || props->allocType != 1) return sim_fail(INVALID_VALUE, __func__);
    if (props->handleTypes & ~HANDLE_POSIX_FD) return sim_fail(NOT_SUPPORTED, __func__);
    int t = props->location.type;
    if (t == LOC_DEVICE) {
        CUresult r = sim_check_device(props->location.id);
        if (r) return sim_fail(INVALID_VALUE, __func__);
    } else if (t != LOC_HOST && t != LOC_HOST_NUMA && t != LOC_HOST_NUMA_CURRENT) {
        return sim_fail(INVALID_VALUE, __func__);
    }
    pthread_mutex_lock(&sim_lock);
    CUresult r = pool_make(out, pool_device(props), props);
    pthread_mutex_unlock(&sim_lock);
    return r ? sim_fail(r, __func__) : SUCCESS;
}

static CUresult device_pool(CUmemoryPool *out, CUdevice dev, struct sim_pool **slot) {
    CUresult r = sim_check_device(dev);
    if (r) return sim_fail(r, "cuDeviceGetMemPool");
    if (!out) return sim_fail(INVALID_VALUE, "cuDeviceGetMemPool");
    pthread_mutex_lock(&sim_lock);
    if (!default_pool[dev]) {
        CUmemPoolProps props = {.allocType = 1, .location = {LOC_DEVICE, dev}};
        r = pool_make(&default_pool[dev], dev, &props);
    }
    if (!r && !slot[dev]) slot[dev] = default_pool[dev];
    if (!r) *out = slot[dev];
    pthread_mutex_unlock(&sim_lock);
    return r ? sim_fail(r, "cuDeviceGetMemPool") : SUCCESS;
}

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool *out, CUdevice dev) { return device_pool(out, dev, default_pool); }
CUresult cuDeviceGetMemPool(CUmemoryPool *out, CUdevice dev) { return device_pool(out, dev, current_pool); }

CUresult cuDeviceSetMemPool(CUdevice dev, CUmemoryPool pool) {
    CUresult r = sim_check_device(dev);
    if (r) return sim_fail(r, __func__);
    if (!pool_ok(pool) || pool->device != dev) return sim_fail(INVALID_VALUE, __func__);
    current_pool[dev] = pool;
    return SUCCESS;
}

/* First fit over the pool's live records (kept in the shared header); offsets page aligned. */
static CUresult pool_alloc(struct sim_pool *p, size_t size, uintptr_t *out) {
    size_t need = (size + 4095) / 4096 * 4096;
    if (!need) need = 4096;
    struct hdr *h = p->hdr;
    hdr_lock(h);
    if (h->n_rec >= MAX_REC) { pthread_mutex_unlock(&h->lock); return OUT_OF_MEMORY; }
    uint64_t at = 0;
    for (int moved = 1; moved;) {
        moved = 0;
        for (uint32_t i = 0; i < h->n_rec; i++) {
            struct rec *r = &h->rec[i];
            if (at < r->offset + r->size && r->offset < at + need) { at = r->offset + r->size; moved = 1; }
        }
    }
    if (at + need > p->max_size) { pthread_mutex_unlock(&h->lock); return OUT_OF_MEMORY; }
    struct rec *r = &h->rec[h->n_rec++];
    memset(r, 0, sizeof *r);
    r->offset = at; r->size = need; r->serial = ++h->next_serial;
    pthread_mutex_unlock(&h->lock);
    struct sim_range range = {(uintptr_t)(p->base + at), need, RANGE_POOL,
                              p->device >= 0 ? MEMTYPE_DEVICE : MEMTYPE_HOST, p->device, p, NULL, 0};
    if (sim_range_add(range)) return OUT_OF_MEMORY;
    p->used += need;
    if (p->device >= 0) sim_device_bytes += need;
    if (p->used > p->used_high) p->used_high = p->used;
    uint64_t reserved = (p->used + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
    if (reserved > p->reserved_high) p->reserved_high = reserved;
    *out = (uintptr_t)(p->base + at);
    return SUCCESS;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *out, size_t size, CUmemoryPool pool, CUstream s) {
    if (!out) return sim_fail(INVALID_VALUE, __func__);
    if (!pool_ok(pool) || pool->imported || pool->closing) return sim_fail(INVALID_VALUE, __func__);
    CUresult r = sim_stream_check(s, NULL);
    if (r) return sim_fail(r, __func__);
    uintptr_t p;
    pthread_mutex_lock(&sim_lock);
    r = pool_alloc(pool, size, &p);
    pthread_mutex_unlock(&sim_lock);
    if (r) return sim_fail(r, __func__);
    *out = p;
    return SUCCESS;
}

CUresult cuMemAllocAsync(CUdeviceptr *out, size_t size, CUstream s) {
    int dev;
    CUresult r = sim_stream_check(s, &dev);
    if (r) return sim_fail(r, __func__);
    CUmemoryPool pool;
    r = cuDeviceGetMemPool(&pool, dev);
    return r ? r : cuMemAllocFromPoolAsync(out, size, pool, s);
}

CUresult cuMemAlloc_v2(CUdeviceptr *out, size_t size) {
    CUcontext c = sim_current_ctx();
    if (!c) return sim_fail(INVALID_CONTEXT, __func__);
    CUmemoryPool pool;
    CUresult r = cuDeviceGetDefaultMemPool(&pool, sim_ctx_device(c));
    return r ? r : cuMemAllocFromPoolAsync(out, size, pool, NULL);
}

static size_t pool_ranges(struct sim_pool *p) {
    size_t n = 0;
    for (size_t i = 0; i < n_ranges; i++) n += ranges[i].pool == p;
    return n;
}

/* Release a destroyed pool for good: its memory is gone, for its importers too. sim_lock held. */
static void pool_finalize(struct sim_pool *pool) {
    if (!pool->imported) {
        sim_punch(pool->fd, HDR_SIZE, pool->max_size);
        close(pool->fd);
    }
    munmap(pool->hdr, HDR_SIZE + pool->max_size);
    pool->magic = 0;
    free(pool);
}

/* Free a pool allocation (exporter) or drop an import (importer); sim_lock held. */
static CUresult pool_free(struct sim_range *range) {
    struct sim_pool *p = range->pool;
    uint64_t offset = range->base - (uintptr_t)p->base, size = range->size;
    struct hdr *h = p->hdr;
    int breach = 0;
    hdr_lock(h);
    struct rec *r = rec_find(h, offset);
    if (range->imported) {
        for (int i = 0; r && i < MAX_IMPORTERS; i++)
            if (r->pid[i] == getpid() && r->count[i] > 0) { r->count[i]--; break; }
    } else if (r) {
        breach = sim_live_importers(r) > 0;
        *r = h->rec[--h->n_rec];
    }
    pthread_mutex_unlock(&h->lock);
    uintptr_t base = range->base;
    int imported = range->imported;
    sim_range_remove(base);
    if (imported) {
        if (p->closing && !pool_ranges(p)) pool_finalize(p);
        return SUCCESS;
    }
    p->used -= size;
    if (p->device >= 0) sim_device_bytes -= size;
    sim_punch(p->fd, HDR_SIZE + offset, size);
    if (breach) violation("an exporter freed pool memory", base);
    if (p->closing && !pool_ranges(p)) pool_finalize(p);
    return SUCCESS;
}

CUresult cuMemFreeAsync(CUdeviceptr ptr, CUstream s) {
    CUresult r = sim_stream_check(s, NULL);
    if (r && r != INVALID_CONTEXT) return sim_fail(r, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_range *range = sim_range_at((uintptr_t)ptr);
    if (!range || range->kind != RANGE_POOL) { pthread_mutex_unlock(&sim_lock); return sim_fail(INVALID_VALUE, __func__); }
    r = pool_free(range);
    pthread_mutex_unlock(&sim_lock);
    return r;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) { return cuMemFreeAsync(ptr, NULL); }

/* As in CUDA: with allocations outstanding the pool goes when the last one is freed; no new
 * allocations or imports meanwhile. Then its memory is gone, for its importers too. */
CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    if (!pool_ok(pool) || pool->closing) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    for (int d = 0; d < MAX_GPUS; d++)
        if (default_pool[d] == pool) { pthread_mutex_unlock(&sim_lock); return sim_fail(INVALID_VALUE, __func__); }
    if (!pool->imported) {
        hdr_lock(pool->hdr);
        pool->hdr->destroyed = 1;
        pthread_mutex_unlock(&pool->hdr->lock);
    }
    pool->closing = 1;
    if (!pool_ranges(pool)) pool_finalize(pool);
    pthread_mutex_unlock(&sim_lock);
    return SUCCESS;
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    (void)keep;
    return pool_ok(pool) ? SUCCESS : sim_fail(INVALID_VALUE, __func__);
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void *value) {
    if (!pool_ok(pool) || !value) return sim_fail(INVALID_VALUE, __func__);
    switch (attr) {
    case 1: case 2: case 3: pool->reuse[attr - 1] = *(int *)value; return SUCCESS;
    case 4: pool->threshold = *(uint64_t *)value; return SUCCESS;
    case 6: pool->reserved_high = 0; return SUCCESS;   /* only 0 may be written to the highs */
    case 8: pool->used_high = 0; return SUCCESS;
    default: return sim_fail(INVALID_VALUE, __func__);
    }
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void *value) {
    if (!pool_ok(pool) || !value) return sim_fail(INVALID_VALUE, __func__);
    uint64_t reserved = (pool->used + GRANULARITY - 1) / GRANULARITY * GRANULARITY;
    switch (attr) {
    case 1: case 2: case 3: *(int *)value = pool->reuse[attr - 1]; return SUCCESS;
    case 4: *(uint64_t *)value = pool->threshold; return SUCCESS;
    case 5: *(uint64_t *)value = reserved; return SUCCESS;
    case 6: *(uint64_t *)value = pool->reserved_high; return SUCCESS;
    case 7: *(uint64_t *)value = pool->used; return SUCCESS;
    case 8: *(uint64_t *)value = pool->used_high; return SUCCESS;
    case 9: *(int *)value = 1; return SUCCESS;
    case 10: *(int *)value = pool->hdr->handle_types; return SUCCESS;
    case 11: *(int *)value = pool->device >= 0 ? pool->device : pool->hdr->loc_id; return SUCCESS;
    case 12: *(int *)value = pool->hdr->loc_type; return SUCCESS;
    case 13: *(size_t *)value = pool->max_size; return SUCCESS;
    default: return sim_fail(INVALID_VALUE, __func__);
    }
}

CUresult cuMemPoolSetAccess(CUmemoryPool pool, const CUmemAccessDesc *map, size_t count) {
    if (!pool_ok(pool) || (count && !map)) return sim_fail(INVALID_VALUE, __func__);
    for (size_t i = 0; i < count; i++) {
        if (map[i].location.type != LOC_DEVICE || sim_check_device(map[i].location.id))
            return sim_fail(INVALID_DEVICE, __func__);
        if (map[i].location.id == pool->device) pool->access = map[i].flags;
    }
    return SUCCESS;
}

CUresult cuMemPoolGetAccess(int *flags, CUmemoryPool pool, const CUmemLocation *loc) {
    if (!flags || !loc || !pool_ok(pool)) return sim_fail(INVALID_VALUE, __func__);
    *flags = (loc->type == LOC_DEVICE && loc->id == pool->device) ? pool->access : 0;
    return SUCCESS;
}

/* ---- plain host allocations ---- */
CUresult cuMemAllocHost_v2(void **out, size_t size) {
    if (!out || !size) return sim_fail(INVALID_VALUE, __func__);
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return sim_fail(OUT_OF_MEMORY, __func__);
    pthread_mutex_lock(&sim_lock);
    sim_range_add((struct sim_range){(uintptr_t)p, size, RANGE_HOST, MEMTYPE_HOST, -1, NULL, NULL, 0});
    pthread_mutex_unlock(&sim_lock);
    *out = p;
    return SUCCESS;
}

CUresult cuMemHostAlloc(void **out, size_t size, unsigned flags) { (void)flags; return cuMemAllocHost_v2(out, size); }

CUresult cuMemFreeHost(void *p) {
    pthread_mutex_lock(&sim_lock);
    struct sim_range *r = sim_range_at((uintptr_t)p);
    size_t size = r && r->kind == RANGE_HOST ? r->size : 0;
    if (size) sim_range_remove((uintptr_t)p);
    pthread_mutex_unlock(&sim_lock);
    if (!size) return sim_fail(INVALID_VALUE, __func__);
    munmap(p, size);
    return SUCCESS;
}

/* Simulator-only: how many times an exporter freed memory a live importer held. */
long gpu_serde_sim_violations(void) { return violations; }

/* CUDA 13: the default (or current) pool of a location; host pools are one per process. */
static struct sim_pool *host_default;
static CUresult location_pool(CUmemoryPool *out, const CUmemLocation *loc, int type, int current, const char *fn) {
    if (!out || !loc || type != 1) return sim_fail(INVALID_VALUE, fn);
    if (loc->type == LOC_DEVICE)
        return current ? cuDeviceGetMemPool(out, loc->id) : cuDeviceGetDefaultMemPool(out, loc->id);
    if (loc->type != LOC_HOST && loc->type != LOC_HOST_NUMA) return sim_fail(INVALID_VALUE, fn);
    pthread_mutex_lock(&sim_lock);
    CUresult r = SUCCESS;
    if (!host_default) {
        CUmemPoolProps props = {.allocType = 1, .location = *loc};
        r = pool_make(&host_default, -1, &props);
    }
    if (!r) *out = host_default;
    pthread_mutex_unlock(&sim_lock);
    return r ? sim_fail(r, fn) : SUCCESS;
}

CUresult cuMemGetDefaultMemPool(CUmemoryPool *out, CUmemLocation *loc, int type) {
    return location_pool(out, loc, type, 0, __func__);
}

CUresult cuMemGetMemPool(CUmemoryPool *out, CUmemLocation *loc, int type) {
    return location_pool(out, loc, type, 1, __func__);
}
