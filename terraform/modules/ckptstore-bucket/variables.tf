variable "bucket_name" {
  description = "Name of the checkpoint bucket. Lowercase letters, digits and hyphens (no dots: they break TLS with virtual-hosted addressing)."
  type        = string

  validation {
    condition     = can(regex("^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$", var.bucket_name)) && !startswith(var.bucket_name, "xn--") && !endswith(var.bucket_name, "-s3alias")
    error_message = "bucket_name must be 3-63 characters of lowercase letters, digits and hyphens, starting and ending with a letter or digit (and not start with xn-- or end with -s3alias)."
  }
}

variable "run_prefix" {
  description = "Key prefix of the store inside the bucket, without leading or trailing slash (for example \"llama-8b/grpo\"). The training URI is s3://<bucket_name>/<run_prefix>; IAM access is limited to this prefix."
  type        = string

  validation {
    # No '*' or '?': they are wildcards in IAM resource ARNs and in StringLike conditions.
    condition     = length(var.run_prefix) <= 512 && can(regex("^[A-Za-z0-9_-][A-Za-z0-9_.=-]*(/[A-Za-z0-9_-][A-Za-z0-9_.=-]*)*$", var.run_prefix))
    error_message = "run_prefix must be non-empty, at most 512 characters, segments of letters, digits, '_', '-', '.', '=' separated by single '/', with no leading or trailing '/' and no '*' or '?'."
  }
}

variable "versioning_enabled" {
  description = "Turn on S3 versioning. Off by default: ckptstore's retention deletes old steps, and with versioning on those deletes only hide them (delete markers), so their bytes stay billed until noncurrent_version_expiration_days pass. Turn it on to recover from mistaken deletes, and for cross-region replication (which requires it)."
  type        = bool
  default     = false
  nullable    = false
}

variable "noncurrent_version_expiration_days" {
  description = "With versioning on: days after which a noncurrent (deleted or overwritten) version is removed for good. This is the undo window for pruned checkpoints, paid for in storage."
  type        = number
  default     = 7
  nullable    = false

  validation {
    condition     = var.noncurrent_version_expiration_days >= 1 && var.noncurrent_version_expiration_days <= 3650 && floor(var.noncurrent_version_expiration_days) == var.noncurrent_version_expiration_days
    error_message = "noncurrent_version_expiration_days must be a whole number of days from 1 to 3650."
  }
}

variable "replication" {
  description = "Optional cross-region replication of the run prefix to another bucket (for example a second instance of this module in another region, with versioning on), so that a job can resume there. Requires versioning_enabled = true. Same AWS account only."
  type = object({
    destination_bucket_arn   = string
    destination_kms_key_arn  = string
    storage_class            = optional(string, "STANDARD")
    replicate_delete_markers = optional(bool, true)
    replication_time_control = optional(bool, false)
  })
  default = null

  validation {
    condition     = var.replication == null || can(regex("^arn:[a-z-]+:s3:::[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.replication.destination_bucket_arn))
    error_message = "replication.destination_bucket_arn must be an S3 bucket ARN (arn:aws:s3:::name)."
  }

  validation {
    condition     = var.replication == null || can(regex("^arn:[a-z-]+:kms:[a-z0-9-]+:[0-9]{12}:key/.+$", var.replication.destination_kms_key_arn))
    error_message = "replication.destination_kms_key_arn must be a KMS key ARN in the destination region (arn:aws:kms:<region>:<account>:key/<id>)."
  }

  validation {
    condition     = var.replication == null || can(regex("^(STANDARD|STANDARD_IA|INTELLIGENT_TIERING|ONEZONE_IA|GLACIER_IR)$", var.replication.storage_class))
    error_message = "replication.storage_class must be one of STANDARD, STANDARD_IA, INTELLIGENT_TIERING, ONEZONE_IA, GLACIER_IR (a resumable replica must be readable without a restore)."
  }
}

variable "access_log_bucket" {
  description = "Optional: name of an existing bucket that receives S3 server access logs of this bucket (under access_log_prefix). Off by default: every part of every upload is a log line; CloudTrail data events are the other way to audit access."
  type        = string
  default     = null

  validation {
    condition     = var.access_log_bucket == null || can(regex("^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$", var.access_log_bucket))
    error_message = "access_log_bucket must be a bucket name, or null."
  }
}

variable "access_log_prefix" {
  description = "Key prefix of this bucket's access logs in access_log_bucket."
  type        = string
  default     = "s3-access-logs/"
  nullable    = false
}

variable "kms_deletion_window_days" {
  description = "Waiting period before a scheduled deletion of the bucket's KMS key takes effect. Deleting the key makes every checkpoint in the bucket unreadable."
  type        = number
  default     = 30
  nullable    = false

  validation {
    condition     = var.kms_deletion_window_days >= 7 && var.kms_deletion_window_days <= 30
    error_message = "kms_deletion_window_days must be from 7 to 30."
  }
}

variable "kms_key_administrator_arns" {
  description = "IAM principals (role or user ARNs) that administer the KMS key (not use it). The account itself can always delegate through IAM policies."
  type        = list(string)
  default     = []
  nullable    = false

  validation {
    condition     = alltrue([for arn in var.kms_key_administrator_arns : can(regex("^arn:[a-z-]+:iam::[0-9]{12}:(role|user)/.+$", arn))])
    error_message = "kms_key_administrator_arns must hold IAM role or user ARNs."
  }
}

variable "training_role_names" {
  description = "Names of existing IAM roles (training jobs) to attach the read-write policy to. The policy is created either way; its ARN is an output."
  type        = list(string)
  default     = []
  nullable    = false
}

variable "read_only_role_names" {
  description = "Names of existing IAM roles (evaluation jobs) to attach the read-only policy to."
  type        = list(string)
  default     = []
  nullable    = false
}

variable "iam_name_prefix" {
  description = "Prefix of the names of the IAM policies, the replication role and the KMS alias this module creates. Defaults to \"ckptstore-<bucket_name>\"."
  type        = string
  default     = null

  validation {
    # Valid in IAM names and in KMS alias names alike.
    condition     = var.iam_name_prefix == null || can(regex("^[A-Za-z0-9_-]{1,100}$", var.iam_name_prefix))
    error_message = "iam_name_prefix must be 1-100 characters of letters, digits, '_' and '-'."
  }
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete a bucket that still holds checkpoints. Keep false outside throwaway environments."
  type        = bool
  default     = false
  nullable    = false
}

variable "tags" {
  description = "Tags for every resource that takes them."
  type        = map(string)
  default     = {}
  nullable    = false
}
