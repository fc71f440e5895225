/* Internal declarations shared by the native sources (not part of the public API). */
#ifndef OFF_COMMON_H
#define OFF_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include "offload.h"

#define OFF_VERSION_MAJOR 0
#define OFF_VERSION_MINOR 1
#define OFF_VERSION_PATCH 0

#define OFF_EXPORT __attribute__((visibility("default")))

/* Level picked once at load by dispatch.c (may be lowered by off_simd_set_level). */
int off__simd_current(void);
int off__threads_default(void);

#endif
