/*
 * psd_sigbus.h -- the SIGBUS handler of sigbus.c, for every process that maps an arena.
 */
#ifndef PSD_SIGBUS_H
#define PSD_SIGBUS_H

/* Install the handler: a SIGBUS on a mapping of /dev/shm/psd.* writes what happened and what to do to
 * stderr and _exit(status)s; any other SIGBUS keeps its default action. Returns 0 or an errno. */
int psd_sigbus_install(int status);

#include <stdbool.h>
#include <stddef.h>

/* Recover from a SIGBUS on an arena mapping instead of exiting (the processes that supervise a job):
 * the faulting mapping becomes anonymous zero pages, noted as lost (sigbus.c). */
void psd_sigbus_recover(bool on);

/* Whether any part of [base, base + size) was lost to a SIGBUS and replaced by zero pages. */
bool psd_sigbus_lost(const void *base, size_t size);

/* [base, base + size) was unmapped: forget its lost ranges (a new mapping may take the addresses). */
void psd_sigbus_forget(const void *base, size_t size);

#endif
