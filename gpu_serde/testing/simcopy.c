/*
 * gpu_serde stand-in CUDA driver: copies, memsets, pointer attributes, memory info.
 *
 * Copies and memsets run inside the call (the stream is checked; with GPU_SERDE_SIM_WORK_MS, an async
 * one keeps its stream busy that much longer; as in CUDA, a device-to-device copy or a memset
 * without a stream is work on the legacy default stream, and a copy to or from the host first
 * waits for that stream's work). The device side of
 * a DtoH, HtoD or DtoD copy and every memset must lie inside memory this process allocated or
 * imported, else CUDA_ERROR_INVALID_VALUE (so a stale pointer fails instead of crashing); the host
 * side of a copy is any host address, as with unified addressing.
 */
#define _GNU_SOURCE
#include <string.h>

#include "simdriver.h"

static CUresult dev_ok(CUdeviceptr p, size_t n) {
    pthread_mutex_lock(&sim_lock);
    struct sim_range *r = sim_range_find((uintptr_t)p, n ? n : 1);
    pthread_mutex_unlock(&sim_lock);
    return r ? SUCCESS : INVALID_VALUE;
}

static CUresult copy(void *dst, const void *src, size_t n, int dst_dev, int src_dev, CUstream s, const char *fn) {
    CUresult r = sim_stream_check(s, NULL);
    if (r) return sim_fail(r, fn);
    if (n == 0) return SUCCESS;
    if (!dst || !src) return sim_fail(INVALID_VALUE, fn);
    if (dst_dev && dev_ok((uintptr_t)dst, n)) return sim_fail(INVALID_VALUE, fn);
    if (src_dev && dev_ok((uintptr_t)src, n)) return sim_fail(INVALID_VALUE, fn);
    memmove(dst, src, n);
    return SUCCESS;
}

#define P(x) ((void *)(uintptr_t)(x))
/* An async call: on success, its stream has that much more work queued. */
static CUresult queued(CUresult r, CUstream s) {
    if (r == SUCCESS) sim_stream_queue(s);
    return r;
}
CUresult cuMemcpy(CUdeviceptr d, CUdeviceptr s, size_t n) { sim_wait_legacy(); return copy(P(d), P(s), n, 0, 0, NULL, __func__); }
CUresult cuMemcpyAsync(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return queued(copy(P(d), P(s), n, 0, 0, st, __func__), st); }
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n) { sim_wait_legacy(); return copy(P(d), s, n, 1, 0, NULL, __func__); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *s, size_t n, CUstream st) { return queued(copy(P(d), s, n, 1, 0, st, __func__), st); }
CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n) { sim_wait_legacy(); return copy(d, P(s), n, 0, 1, NULL, __func__); }
CUresult cuMemcpyDtoHAsync_v2(void *d, CUdeviceptr s, size_t n, CUstream st) { return queued(copy(d, P(s), n, 0, 1, st, __func__), st); }
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) { return queued(copy(P(d), P(s), n, 1, 1, NULL, __func__), NULL); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) { return queued(copy(P(d), P(s), n, 1, 1, st, __func__), st); }
CUresult cuMemcpyPeer(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n) {
    if (sim_ctx_device(dc) < 0 || sim_ctx_device(sc) < 0) return sim_fail(INVALID_CONTEXT, __func__);
    sim_wait_legacy();
    return copy(P(d), P(s), n, 1, 1, NULL, __func__);
}
CUresult cuMemcpyPeerAsync(CUdeviceptr d, CUcontext dc, CUdeviceptr s, CUcontext sc, size_t n, CUstream st) {
    if (sim_ctx_device(dc) < 0 || sim_ctx_device(sc) < 0) return sim_fail(INVALID_CONTEXT, __func__);
    return queued(copy(P(d), P(s), n, 1, 1, st, __func__), st);
}

static CUresult fill(CUdeviceptr d, const void *value, size_t width, size_t count, CUstream s, const char *fn) {
    CUresult r = sim_stream_check(s, NULL);
    if (r) return sim_fail(r, fn);
    if (count == 0) return SUCCESS;
    if (d % width || dev_ok(d, width * count)) return sim_fail(INVALID_VALUE, fn);
    unsigned char *p = P(d);
    if (width == 1) { memset(p, *(const unsigned char *)value, count); return SUCCESS; }
    for (size_t i = 0; i < count; i++) memcpy(p + i * width, value, width);
    return SUCCESS;
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return queued(fill(d, &v, 1, n, NULL, __func__), NULL); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) { return queued(fill(d, &v, 1, n, s, __func__), s); }
CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { return queued(fill(d, &v, 2, n, NULL, __func__), NULL); }
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s) { return queued(fill(d, &v, 2, n, s, __func__), s); }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) { return queued(fill(d, &v, 4, n, NULL, __func__), NULL); }
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream s) { return queued(fill(d, &v, 4, n, s, __func__), s); }

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!free_bytes || !total) return sim_fail(INVALID_VALUE, __func__);
    *total = SIM_TOTAL_MEM;
    *free_bytes = sim_device_bytes < SIM_TOTAL_MEM ? SIM_TOTAL_MEM - sim_device_bytes : 0;
    return SUCCESS;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
    pthread_mutex_lock(&sim_lock);
    struct sim_range *r = sim_range_find((uintptr_t)p, 1);
    if (r) { if (base) *base = r->base; if (size) *size = r->size; }
    pthread_mutex_unlock(&sim_lock);
    return r ? SUCCESS : sim_fail(NOT_FOUND, __func__);
}

extern CUresult cuDevicePrimaryCtxRetain(CUcontext *out, CUdevice dev);
extern CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev);

/* One attribute of the range holding p (r), or of host memory the driver does not know (r NULL). */
static CUresult attribute(void *data, int attr, CUdeviceptr p, struct sim_range *r) {
    int dev = r ? r->device : -1;
    switch (attr) {
    case 1: /* CONTEXT */
        if (!r || dev < 0) { *(CUcontext *)data = NULL; return r ? SUCCESS : INVALID_VALUE; }
        cuDevicePrimaryCtxRetain((CUcontext *)data, dev);
        cuDevicePrimaryCtxRelease_v2(dev);
        return SUCCESS;
    case 2: if (!r) return INVALID_VALUE; *(unsigned *)data = (unsigned)r->memtype; return SUCCESS;
    case 3: case 4: if (!r) return INVALID_VALUE; *(CUdeviceptr *)data = p; return SUCCESS;
    case 6: *(int *)data = 1; return r ? SUCCESS : INVALID_VALUE;
    case 7: *(unsigned long long *)data = r ? r->base : 0; return r ? SUCCESS : INVALID_VALUE;
    case 8: *(int *)data = 0; return r ? SUCCESS : INVALID_VALUE;
    case 9: if (!r) return INVALID_VALUE; *(int *)data = dev >= 0 ? dev : 0; return SUCCESS;
    case 10: *(int *)data = 0; return r ? SUCCESS : INVALID_VALUE;
    case 11: if (!r) return INVALID_VALUE; *(CUdeviceptr *)data = r->base; return SUCCESS;
    case 12: if (!r) return INVALID_VALUE; *(size_t *)data = r->size; return SUCCESS;
    case 13: *(int *)data = r != NULL; return SUCCESS;
    case 14: *(unsigned long long *)data = r && r->kind == RANGE_VMM ? HANDLE_POSIX_FD : 0; return r ? SUCCESS : INVALID_VALUE;
    case 15: *(int *)data = 0; return r ? SUCCESS : INVALID_VALUE;
    case 16: *(unsigned long long *)data = 3; return r ? SUCCESS : INVALID_VALUE;
    case 17: *(CUmemoryPool *)data = r && r->kind == RANGE_POOL ? r->pool : NULL; return r ? SUCCESS : INVALID_VALUE;
    case 18: if (!r) return INVALID_VALUE; *(size_t *)data = r->size; return SUCCESS;
    case 19: if (!r) return INVALID_VALUE; *(CUdeviceptr *)data = r->base; return SUCCESS;
    case 20: *(unsigned long long *)data = r ? r->base : 0; return r ? SUCCESS : INVALID_VALUE;
    case 21: *(int *)data = 0; return r ? SUCCESS : INVALID_VALUE;
    default: return INVALID_VALUE;
    }
}

CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
    if (!data) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_range copy_of, *r = sim_range_find((uintptr_t)p, 1);
    if (r) copy_of = *r;
    pthread_mutex_unlock(&sim_lock);
    CUresult res = attribute(data, attr, p, r ? &copy_of : NULL);
    return res ? sim_fail(res, __func__) : SUCCESS;
}

/* The attributes whose value is a pointer, a size or a 64-bit id (the others are ints). */
static int pointer_sized(int attr) {
    switch (attr) {
    case 1: case 3: case 4: case 7: case 11: case 12: case 14: case 16: case 17: case 18: case 19: case 20:
        return 1;
    default:
        return 0;
    }
}

/* Like the real call: attributes of memory the driver does not know read as zeros, with success. */
CUresult cuPointerGetAttributes(unsigned n, int *attrs, void **data, CUdeviceptr p) {
    if (!attrs || !data) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_range copy_of, *r = sim_range_find((uintptr_t)p, 1);
    if (r) copy_of = *r;
    pthread_mutex_unlock(&sim_lock);
    for (unsigned i = 0; i < n; i++) {
        if (!data[i]) continue;
        if (attribute(data[i], attrs[i], p, r ? &copy_of : NULL) != SUCCESS)
            memset(data[i], 0, pointer_sized(attrs[i]) ? sizeof(uint64_t) : sizeof(int));
    }
    return SUCCESS;
}
