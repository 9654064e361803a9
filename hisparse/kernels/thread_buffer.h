// A buffer each thread keeps between a kernel's calls and grows as needed: a fresh allocation a call cost its
// page faults, and OpenMP's threads live on. Contents are not kept across growth.

#pragma once

#include <stdlib.h>

// *buffer (of *size bytes) grown to hold `wanted` bytes; NULL, and nothing kept, without memory.
static inline void *thread_buffer(void **buffer, size_t *size, size_t wanted) {
    if (wanted > *size) {
        free(*buffer);
        *buffer = malloc(wanted);
        *size = *buffer ? wanted : 0;
    }
    return *buffer;
}
