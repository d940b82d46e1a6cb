/*
 * gpu_serde stand-in CUDA driver: a memory pool, shared by simmem.c (allocation) and simipc.c
 * (export and import). The memfd starts with a header that every process mapping the pool shares.
 */
#ifndef GPU_SERDE_SIMPOOL_H
#define GPU_SERDE_SIMPOOL_H
#include <errno.h>
#include <pthread.h>

#include "simdriver.h"

#define HDR_SIZE ((size_t)1 << 20)
#define MAX_IMPORTERS 4
#define POOL_MAGIC 0x4c4f4f50u
#define DEFAULT_POOL_SIZE ((size_t)64 << 30)
struct rec { uint64_t offset, size, serial; int32_t pid[MAX_IMPORTERS], count[MAX_IMPORTERS]; };
struct hdr {
    char tag[8]; uint32_t version; int32_t exporter; unsigned char id[16], device_uuid[16];
    uint64_t max_size; int32_t loc_type, loc_id, handle_types, destroyed;
    pthread_mutex_t lock; uint64_t next_serial; uint32_t n_rec; uint32_t pad;
    struct rec rec[];
};
#define MAX_REC ((HDR_SIZE - sizeof(struct hdr)) / sizeof(struct rec))
extern const char sim_pool_tag[8];

struct sim_pool {
    uint32_t magic; int device, imported, fd; struct hdr *hdr; char *base; size_t max_size;
    uint64_t used, used_high, reserved_high, threshold; int reuse[3]; int access;
    int closing; /* destroyed with allocations outstanding: goes when the last one is freed */
};
static inline int pool_ok(CUmemoryPool p) { return p && p->magic == POOL_MAGIC; }

static inline void hdr_lock(struct hdr *h) {
    if (pthread_mutex_lock(&h->lock) == EOWNERDEAD) pthread_mutex_consistent(&h->lock);
}

static inline struct rec *rec_find(struct hdr *h, uint64_t offset) {
    for (uint32_t i = 0; i < h->n_rec; i++) if (h->rec[i].offset == offset) return &h->rec[i];
    return NULL;
}

int sim_live_importers(struct rec *r);

#endif
