/*
 * gpu_serde stand-in CUDA driver: virtual memory management (cuMemCreate, cuMemMap and friends).
 *
 * Each physical allocation is one memfd (its bytes, then one page that names its location), so a
 * POSIX fd exported with cuMemExportToShareableHandle maps the same bytes in the importer. An address
 * reservation is an inaccessible anonymous mapping; cuMemMap maps the memfd over part of it (read and
 * write at once: cuMemSetAccess is checked and recorded, not enforced). Physical memory is freed when
 * its last handle is released and its last mapping unmapped, as in CUDA.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "simdriver.h"

struct sim_phys { uint32_t magic; int fd; size_t size; int loc_type, loc_id, device, handle_types, refs, imported; };
#define PHYS_MAGIC 0x53594850u
#define TRAILER 4096
struct trailer { char tag[8]; int32_t loc_type, loc_id, handle_types; unsigned char device_uuid[16]; };
static const char phys_tag[8] = "GSSIMVMM";

struct resv { uintptr_t base; size_t size; };
static struct resv *resvs;
static size_t n_resv, cap_resv;

static struct sim_phys *phys_of(CUmemGenericAllocationHandle h) {
    struct sim_phys *p = (struct sim_phys *)(uintptr_t)h;
    return (p && p->magic == PHYS_MAGIC) ? p : NULL;
}

static void phys_unref(struct sim_phys *p) {
    if (--p->refs > 0) return;
    if (p->device >= 0 && !p->imported) sim_device_bytes -= p->size;
    close(p->fd);
    p->magic = 0;
    free(p);
}

static int host_location(int type) { return type == LOC_HOST || type == LOC_HOST_NUMA || type == LOC_HOST_NUMA_CURRENT; }

static CUresult check_prop(const CUmemAllocationProp *prop) {
    if (!prop || prop->type != 1) return INVALID_VALUE;
    if (prop->requestedHandleTypes & ~HANDLE_POSIX_FD) return NOT_SUPPORTED;
    if (prop->location.type == LOC_DEVICE) return sim_check_device(prop->location.id) ? INVALID_DEVICE : SUCCESS;
    return host_location(prop->location.type) ? SUCCESS : INVALID_VALUE;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
    CUresult r = check_prop(prop);
    if (r) return sim_fail(r, __func__);
    if (!g || (option != 0 && option != 1)) return sim_fail(INVALID_VALUE, __func__);
    *g = GRANULARITY;
    return SUCCESS;
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *out, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    CUresult r = check_prop(prop);
    if (r) return sim_fail(r, __func__);
    if (!out || flags || !size || size % GRANULARITY) return sim_fail(INVALID_VALUE, __func__);
    /* no GPU gives one allocation more than its memory (its sparse memfd would take it) */
    if (prop->location.type == LOC_DEVICE && size > SIM_TOTAL_MEM) return sim_fail(OUT_OF_MEMORY, __func__);
    int fd = sim_memfd("gpu_serde-sim-vmm", size + TRAILER);
    if (fd < 0) return sim_fail(OUT_OF_MEMORY, __func__);
    struct trailer t = {"GSSIMVMM", prop->location.type, prop->location.id, prop->requestedHandleTypes, {0}};
    int dev = prop->location.type == LOC_DEVICE ? prop->location.id : -1;
    if (dev >= 0) memcpy(t.device_uuid, sim_device_uuid(dev), 16);
    struct sim_phys *p = calloc(1, sizeof *p);
    if (!p || pwrite(fd, &t, sizeof t, (off_t)size) != (ssize_t)sizeof t) {
        free(p); close(fd);
        return sim_fail(OUT_OF_MEMORY, __func__);
    }
    *p = (struct sim_phys){PHYS_MAGIC, fd, size, t.loc_type, t.loc_id, dev, t.handle_types, 1, 0};
    pthread_mutex_lock(&sim_lock);
    if (dev >= 0) sim_device_bytes += size;
    pthread_mutex_unlock(&sim_lock);
    *out = (uintptr_t)p;
    return SUCCESS;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&sim_lock);
    struct sim_phys *p = phys_of(h);
    if (p) phys_unref(p);
    pthread_mutex_unlock(&sim_lock);
    return p ? SUCCESS : sim_fail(INVALID_VALUE, __func__);
}

CUresult cuMemAddressReserve(CUdeviceptr *out, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)addr;
    if (!out || !size || size % GRANULARITY || flags) return sim_fail(INVALID_VALUE, __func__);
    if (align < GRANULARITY) align = GRANULARITY;
    if (align & (align - 1)) return sim_fail(INVALID_VALUE, __func__);
    char *m = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return sim_fail(OUT_OF_MEMORY, __func__);
    uintptr_t base = ((uintptr_t)m + align - 1) & ~(uintptr_t)(align - 1);
    if (base > (uintptr_t)m) munmap(m, base - (uintptr_t)m);
    if ((uintptr_t)m + align > base) munmap((void *)(base + size), (uintptr_t)m + align - base);
    pthread_mutex_lock(&sim_lock);
    if (n_resv == cap_resv) {
        size_t cap = cap_resv ? 2 * cap_resv : 32;
        struct resv *grown = realloc(resvs, cap * sizeof *grown);
        if (!grown) { pthread_mutex_unlock(&sim_lock); munmap((void *)base, size); return sim_fail(OUT_OF_MEMORY, __func__); }
        resvs = grown; cap_resv = cap;
    }
    resvs[n_resv++] = (struct resv){base, size};
    pthread_mutex_unlock(&sim_lock);
    *out = base;
    return SUCCESS;
}

static struct resv *resv_holding(uintptr_t p, size_t n) {
    for (size_t i = 0; i < n_resv; i++)
        if (p >= resvs[i].base && p - resvs[i].base + n <= resvs[i].size) return &resvs[i];
    return NULL;
}

static int any_mapping_in(uintptr_t p, size_t n) {
    for (uintptr_t a = p; a < p + n; a += GRANULARITY) {
        struct sim_range *r = sim_range_find(a, 1);
        if (r && r->kind == RANGE_VMM) return 1;
    }
    return 0;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&sim_lock);
    size_t i = 0;
    while (i < n_resv && !(resvs[i].base == ptr && resvs[i].size == size)) i++;
    CUresult r = i == n_resv ? INVALID_VALUE : any_mapping_in(ptr, size) ? INVALID_VALUE : SUCCESS;
    if (!r) { resvs[i] = resvs[--n_resv]; munmap((void *)(uintptr_t)ptr, size); }
    pthread_mutex_unlock(&sim_lock);
    return r ? sim_fail(r, __func__) : SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle h, unsigned long long flags) {
    if (flags || !size || size % GRANULARITY || ptr % GRANULARITY || offset % GRANULARITY)
        return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_phys *p = phys_of(h);
    CUresult r = !p ? INVALID_HANDLE : offset + size > p->size ? INVALID_VALUE
               : !resv_holding(ptr, size) ? INVALID_VALUE : any_mapping_in(ptr, size) ? INVALID_VALUE : SUCCESS;
    /* a range mapped twice: CUDA_ERROR_INVALID_VALUE, as the real driver answers (H200, 580) */
    if (!r && mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, p->fd,
                   (off_t)offset) == MAP_FAILED)
        r = OUT_OF_MEMORY;
    if (!r) {
        struct sim_range range = {ptr, size, RANGE_VMM, host_location(p->loc_type) ? MEMTYPE_HOST : MEMTYPE_DEVICE,
                                  p->device, NULL, p, 0};
        if (sim_range_add(range)) r = OUT_OF_MEMORY; else p->refs++;
    }
    pthread_mutex_unlock(&sim_lock);
    return r ? sim_fail(r, __func__) : SUCCESS;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&sim_lock);
    int found = 0;
    CUresult r = resv_holding(ptr, size) ? SUCCESS : INVALID_VALUE;
    for (uintptr_t a = ptr; !r && a < ptr + size;) {
        struct sim_range *m = sim_range_find(a, 1);
        if (!m || m->kind != RANGE_VMM) { a += GRANULARITY; continue; }
        if (m->base < ptr || m->base + m->size > ptr + size) { r = INVALID_VALUE; break; }
        struct sim_phys *p = m->phys;
        uintptr_t base = m->base;
        size_t n = m->size;
        mmap((void *)base, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        sim_range_remove(base);
        phys_unref(p);
        found = 1;
        a = base + n;
    }
    if (!r && !found) r = INVALID_VALUE;
    pthread_mutex_unlock(&sim_lock);
    return r ? sim_fail(r, __func__) : SUCCESS;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    if (!desc || !count) return sim_fail(INVALID_VALUE, __func__);
    for (size_t i = 0; i < count; i++) {
        int t = desc[i].location.type;
        if (t == LOC_DEVICE ? sim_check_device(desc[i].location.id) != SUCCESS : !host_location(t))
            return sim_fail(INVALID_DEVICE, __func__);
        if (desc[i].flags != 0 && desc[i].flags != 1 && desc[i].flags != 3) return sim_fail(INVALID_VALUE, __func__);
    }
    pthread_mutex_lock(&sim_lock);
    int mapped = 1;
    for (uintptr_t a = ptr; a < ptr + size && mapped; a += GRANULARITY) {
        struct sim_range *m = sim_range_find(a, 1);
        mapped = m && m->kind == RANGE_VMM;
    }
    pthread_mutex_unlock(&sim_lock);
    return mapped ? SUCCESS : sim_fail(INVALID_VALUE, __func__);
}

CUresult cuMemGetAccess(unsigned long long *flags, const CUmemLocation *loc, CUdeviceptr ptr) {
    if (!flags || !loc) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_range *m = sim_range_find(ptr, 1);
    int ok = m && m->kind == RANGE_VMM;
    pthread_mutex_unlock(&sim_lock);
    if (!ok) return sim_fail(INVALID_VALUE, __func__);
    *flags = 3;
    return SUCCESS;
}

CUresult cuMemRetainAllocationHandle(CUmemGenericAllocationHandle *out, void *addr) {
    if (!out) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_range *m = sim_range_find((uintptr_t)addr, 1);
    struct sim_phys *p = m && m->kind == RANGE_VMM ? m->phys : NULL;
    if (p) { p->refs++; *out = (uintptr_t)p; }
    pthread_mutex_unlock(&sim_lock);
    return p ? SUCCESS : sim_fail(INVALID_VALUE, __func__);
}

CUresult cuMemGetAllocationPropertiesFromHandle(CUmemAllocationProp *prop, CUmemGenericAllocationHandle h) {
    pthread_mutex_lock(&sim_lock);
    struct sim_phys *p = phys_of(h);
    if (p && prop) {
        memset(prop, 0, sizeof *prop);
        prop->type = 1;
        prop->requestedHandleTypes = p->handle_types;
        prop->location.type = p->loc_type;
        prop->location.id = p->device >= 0 ? p->device : p->loc_id;
    }
    pthread_mutex_unlock(&sim_lock);
    return p && prop ? SUCCESS : sim_fail(INVALID_VALUE, __func__);
}

CUresult cuMemExportToShareableHandle(void *out, CUmemGenericAllocationHandle h, int type, unsigned long long flags) {
    if (!out || flags || type != HANDLE_POSIX_FD) return sim_fail(INVALID_VALUE, __func__);
    pthread_mutex_lock(&sim_lock);
    struct sim_phys *p = phys_of(h);
    int fd = p && (p->handle_types & HANDLE_POSIX_FD) ? fcntl(p->fd, F_DUPFD_CLOEXEC, 0) : -1;
    pthread_mutex_unlock(&sim_lock);
    if (!p) return sim_fail(INVALID_HANDLE, __func__);
    if (fd < 0) return sim_fail(INVALID_VALUE, __func__);
    *(int *)out = fd;
    return SUCCESS;
}

CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *out, void *os_handle, int type) {
    if (!out || type != HANDLE_POSIX_FD) return sim_fail(INVALID_VALUE, __func__);
    int fd = (int)(intptr_t)os_handle;
    struct stat st;
    struct trailer t;
    if (fstat(fd, &st) != 0 || st.st_size < TRAILER + (off_t)GRANULARITY ||
        pread(fd, &t, sizeof t, st.st_size - TRAILER) != (ssize_t)sizeof t || memcmp(t.tag, phys_tag, 8))
        return sim_fail(INVALID_VALUE, __func__);
    int dev = -1;
    if (t.loc_type == LOC_DEVICE && (dev = sim_device_by_uuid(t.device_uuid)) < 0)
        return sim_fail(INVALID_DEVICE, __func__);
    struct sim_phys *p = calloc(1, sizeof *p);
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (!p || own < 0) { free(p); if (own >= 0) close(own); return sim_fail(OUT_OF_MEMORY, __func__); }
    *p = (struct sim_phys){PHYS_MAGIC, own, (size_t)st.st_size - TRAILER, t.loc_type,
                           dev >= 0 ? dev : t.loc_id, dev, t.handle_types, 1, 1};
    *out = (uintptr_t)p;
    return SUCCESS;
}
