"""What bytes can prove about themselves: CRC-32 of zip records, checked whole or in passing
as a job reads them, and the manifest of file digests ckptctl writes last."""
