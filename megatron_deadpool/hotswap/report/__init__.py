"""What a job tells the people and tools watching it: the metrics file for a cluster's
monitoring, the timeline of a run's folder (`deadpool report`), the redundancy status the ranks
log as scalars, and the note printed when a job ends out of redundancy."""
