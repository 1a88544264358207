"""Background builds, held by the process: claims, cores, status and times, and the build processes' launcher."""
