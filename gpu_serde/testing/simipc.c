/*
 * gpu_serde stand-in CUDA driver: pool IPC (cuMemPoolExportToShareableHandle and friends).
 *
 * The shareable handle is a duplicate of the pool's memfd; the importer maps all of it. An exported
 * pointer is the pool's random id, the allocation's offset, size and serial: it imports only into
 * that pool's import in another process, and only while the allocation lives (a freed or
 * destroyed one gives CUDA_ERROR_INVALID_VALUE). Each import is recorded in the shared header
 * (up to four importing processes per allocation), so that an exporter that frees first is seen.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "simpool.h"

CUresult cuMemPoolExportToShareableHandle(void *out, CUmemoryPool pool, int type, unsigned long long flags) {
    if (!out || !pool_ok(pool) || flags) return sim_fail(INVALID_VALUE, __func__);
    if (pool->imported || type != HANDLE_POSIX_FD || !(pool->hdr->handle_types & HANDLE_POSIX_FD))
        return sim_fail(INVALID_VALUE, __func__);
    int fd = fcntl(pool->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0) return sim_fail(OUT_OF_MEMORY, __func__);
    *(int *)out = fd;
    return SUCCESS;
}

CUresult cuMemPoolImportFromShareableHandle(CUmemoryPool *out, void *handle, int type, unsigned long long flags) {
    if (!out || type != HANDLE_POSIX_FD || flags) return sim_fail(INVALID_VALUE, __func__);
    int fd = (int)(intptr_t)handle;
    struct hdr probe;
    if (pread(fd, &probe, sizeof probe, 0) != (ssize_t)sizeof probe || memcmp(probe.tag, sim_pool_tag, 8))
        return sim_fail(INVALID_VALUE, __func__);
    /* A pool may be imported by the process that exported it: the real driver allows it (seen on
       an H200, driver 580). */
    if (probe.destroyed) return sim_fail(INVALID_VALUE, __func__);
    int dev = -1;
    if (probe.loc_type == LOC_DEVICE && (dev = sim_device_by_uuid(probe.device_uuid)) < 0)
        return sim_fail(INVALID_DEVICE, __func__);
    size_t total = HDR_SIZE + probe.max_size;
    char *map = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
    if (map == MAP_FAILED) return sim_fail(OUT_OF_MEMORY, __func__);
    struct sim_pool *p = calloc(1, sizeof *p);
    if (!p) { munmap(map, total); return sim_fail(OUT_OF_MEMORY, __func__); }
    *p = (struct sim_pool){POOL_MAGIC, dev, 1, -1, (struct hdr *)map, map + HDR_SIZE, probe.max_size,
                           0, 0, 0, 0, {1, 1, 1}, 3, 0};
    *out = p;
    return SUCCESS;
}

struct export_data { char tag[8]; unsigned char id[16]; uint64_t offset, size, serial; int32_t exporter; };

CUresult cuMemPoolExportPointer(CUmemPoolPtrExportData *out, CUdeviceptr ptr) {
    if (!out) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_range *range = sim_range_at((uintptr_t)ptr);
    if (!range || range->kind != RANGE_POOL || range->imported) {
        pthread_mutex_unlock(&sim_lock);
        return sim_fail(INVALID_VALUE, __func__);
    }
    struct sim_pool *p = range->pool;
    struct export_data d = {"GSSIMPTR", {0}, ptr - (uintptr_t)p->base, range->size, 0, getpid()};
    memcpy(d.id, p->hdr->id, 16);
    hdr_lock(p->hdr);
    struct rec *r = rec_find(p->hdr, d.offset);
    d.serial = r ? r->serial : 0;
    pthread_mutex_unlock(&p->hdr->lock);
    pthread_mutex_unlock(&sim_lock);
    memset(out, 0, sizeof *out);
    memcpy(out->reserved, &d, sizeof d);
    return SUCCESS;
}

CUresult cuMemPoolImportPointer(CUdeviceptr *out, CUmemoryPool pool, CUmemPoolPtrExportData *data) {
    if (!out || !data || !pool_ok(pool) || !pool->imported || pool->closing) return sim_fail(INVALID_VALUE, __func__);
    struct export_data d;
    memcpy(&d, data->reserved, sizeof d);
    if (memcmp(d.tag, "GSSIMPTR", 8) || memcmp(d.id, pool->hdr->id, 16)) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct hdr *h = pool->hdr;
    hdr_lock(h);
    struct rec *r = h->destroyed ? NULL : rec_find(h, d.offset);
    int slot = -1;
    if (r && r->serial == d.serial && r->size == d.size) {
        for (int i = 0; i < MAX_IMPORTERS && slot < 0; i++) if (r->pid[i] == getpid()) slot = i;
        for (int i = 0; i < MAX_IMPORTERS && slot < 0; i++)
            if (r->count[i] <= 0 || (kill(r->pid[i], 0) != 0 && errno == ESRCH)) { slot = i; r->count[i] = 0; }
        if (slot >= 0) { r->pid[slot] = getpid(); r->count[slot]++; }
    }
    pthread_mutex_unlock(&h->lock);
    uintptr_t at = (uintptr_t)(pool->base + d.offset);
    CUresult res = !r || r->serial != d.serial ? INVALID_VALUE : slot < 0 ? OUT_OF_MEMORY
                 : sim_range_at(at) ? ALREADY_MAPPED : SUCCESS;
    if (res == SUCCESS) {
        struct sim_range range = {at, d.size, RANGE_POOL, pool->device >= 0 ? MEMTYPE_DEVICE : MEMTYPE_HOST,
                                  pool->device, pool, NULL, 1};
        if (sim_range_add(range)) res = OUT_OF_MEMORY;
    }
    if (res != SUCCESS && slot >= 0) { hdr_lock(h); r->count[slot]--; pthread_mutex_unlock(&h->lock); }
    pthread_mutex_unlock(&sim_lock);
    if (res) return sim_fail(res, __func__);
    *out = at;
    return SUCCESS;
}

