# A private, KMS-encrypted, TLS-only bucket for ckptstore checkpoints.

data "aws_caller_identity" "current" {}

data "aws_partition" "current" {}

locals {
  account_root = "arn:${data.aws_partition.current.partition}:iam::${data.aws_caller_identity.current.account_id}:root"
  iam_name     = coalesce(var.iam_name_prefix, "ckptstore-${var.bucket_name}")
  region       = aws_s3_bucket.this.region
  # KMS requests that S3 makes on a caller's behalf carry kms:ViaService = this name.
  s3_service = "s3.${local.region}.${data.aws_partition.current.dns_suffix}"
}

resource "aws_s3_bucket" "this" {
  bucket        = var.bucket_name
  force_destroy = var.force_destroy
  tags          = var.tags
}

# All four settings: no ACL or policy can ever make an object public.
resource "aws_s3_bucket_public_access_block" "this" {
  bucket = aws_s3_bucket.this.id

  block_public_acls       = true
  block_public_policy     = true
  ignore_public_acls      = true
  restrict_public_buckets = true
}

# ACLs off: the bucket owner owns every object, access is decided by policies alone.
resource "aws_s3_bucket_ownership_controls" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    object_ownership = "BucketOwnerEnforced"
  }
}

# SSE-KMS with the module's own key. ckptstore sends no encryption headers: this default applies
# to every PutObject and CreateMultipartUpload. The S3 bucket key cuts KMS requests (and cost)
# from one per object to about one per bucket key lifetime.
resource "aws_s3_bucket_server_side_encryption_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    apply_server_side_encryption_by_default {
      sse_algorithm     = "aws:kms"
      kms_master_key_id = aws_kms_key.this.arn
    }
    bucket_key_enabled = true
  }
}

# Versioning is optional; see var.versioning_enabled and the README for the trade-off.
# Removing this resource later suspends versioning (existing versions stay until they expire).
resource "aws_s3_bucket_versioning" "this" {
  count  = var.versioning_enabled ? 1 : 0
  bucket = aws_s3_bucket.this.id

  versioning_configuration {
    status = "Enabled"
  }
}

resource "aws_s3_bucket_lifecycle_configuration" "this" {
  bucket = aws_s3_bucket.this.id

  rule {
    id     = "ckptstore-cleanup"
    status = "Enabled"

    filter {}

    # A killed trainer can leave a multipart upload behind; its parts are billed until aborted.
    # No checkpoint upload takes a day, so anything older is garbage (`ckptstore gc` finds
    # them sooner).
    abort_incomplete_multipart_upload {
      days_after_initiation = 1
    }

    # With versioning on, ckptstore's retention deletes leave noncurrent versions and delete
    # markers behind: remove them after the undo window.
    dynamic "noncurrent_version_expiration" {
      for_each = var.versioning_enabled ? [1] : []

      content {
        noncurrent_days = var.noncurrent_version_expiration_days
      }
    }

    dynamic "expiration" {
      for_each = var.versioning_enabled ? [1] : []

      content {
        expired_object_delete_marker = true
      }
    }
  }

  depends_on = [aws_s3_bucket_versioning.this]
}

resource "aws_s3_bucket_logging" "this" {
  count  = var.access_log_bucket == null ? 0 : 1
  bucket = aws_s3_bucket.this.id

  target_bucket = var.access_log_bucket
  target_prefix = "${var.access_log_prefix}${var.bucket_name}/"
}

data "aws_iam_policy_document" "bucket" {
  statement {
    sid     = "DenyInsecureTransport"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "Bool"
      variable = "aws:SecureTransport"
      values   = ["false"]
    }
  }

  statement {
    sid     = "DenyOutdatedTLS"
    effect  = "Deny"
    actions = ["s3:*"]
    resources = [
      aws_s3_bucket.this.arn,
      "${aws_s3_bucket.this.arn}/*",
    ]

    principals {
      type        = "*"
      identifiers = ["*"]
    }

    condition {
      test     = "NumericLessThan"
      variable = "s3:TlsVersion"
      values   = ["1.2"]
    }
  }
}

resource "aws_s3_bucket_policy" "this" {
  bucket = aws_s3_bucket.this.id
  policy = data.aws_iam_policy_document.bucket.json

  # A policy put before the public access block exists could be refused as public.
  depends_on = [aws_s3_bucket_public_access_block.this]
}
