/*
 * psd_sigbus.h -- the SIGBUS handler of sigbus.c, for every process that maps an arena.
 */
#ifndef PSD_SIGBUS_H
#define PSD_SIGBUS_H

/* Install the handler: a SIGBUS on a mapping of /dev/shm/psd.* writes what happened and what to do to
 * stderr and _exit(status)s; any other SIGBUS keeps its default action. Returns 0 or an errno. */
int psd_sigbus_install(int status);

#endif
